"""Memory profiler: where training memory goes under BF16 AdamW and under COAT, and the
largest micro-batch each fits. Command line: `python -m coat_ds.profile` (docs/profiler.md)."""
from .measure import ActivationPoint, SideMeasurement, measure_side
from .options import ProfileOptions, parse_options
from .run import profile
from .search import Trial, search_max_batch

__all__ = ["profile", "ProfileOptions", "parse_options", "SideMeasurement", "ActivationPoint", "measure_side",
           "search_max_batch", "Trial"]
