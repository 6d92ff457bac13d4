"""One call for coat_ds's model edits: `prepare(model, recipe=...)` (prepare.py) and the report
it returns (report.py). Each edit is also public on its own."""
from ..config import RECIPES, RecipeConfig
from .prepare import prepare
from .report import PrepareReport, Step

__all__ = ["prepare", "PrepareReport", "Step", "RecipeConfig", "RECIPES"]
