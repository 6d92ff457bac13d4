"""The training harness train.py runs: its settings (`config`), data and metrics log. The
library never imports it."""
