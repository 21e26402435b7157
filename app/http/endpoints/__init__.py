"""HTTP routes, one APIRouter per concern; app.main includes them all."""
