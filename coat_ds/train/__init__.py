"""The training harness train.py runs: its settings (`config`), data, the engines' optimizer
and batch settings (`engine_setup`), the planning step (`planning`) and metrics log. The
library never imports it."""
