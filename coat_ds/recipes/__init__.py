"""One call for coat_ds's model edits: `prepare(model, recipe=...)` (prepare.py), the report it
returns (report.py), and the one edit that lives here, `compile_regions` (regions.py). Each edit
is also public on its own."""
from ..config import RECIPES, RecipeConfig
from .prepare import prepare
from .regions import compile_regions
from .report import PrepareReport, Step

__all__ = ["prepare", "compile_regions", "PrepareReport", "Step", "RecipeConfig", "RECIPES"]
