"""An HTTP front end process (`--workers F` of them; the supervisor runs the first in its own
process): the FastAPI app and uvicorn server (app.py, server.py), the one request path every
route goes through (pipeline.py: admission, the compute cap, the memory budget, validation), and
the links to the model workers (engine.py, submission.py). HTTP-level limits on connections and
bodies are in http/, the protocol routes in routes/. A front end holds a view of each model
(service/hosted_model.py), never a model: it imports no model family and none of service/worker/
(the import-linter contracts in pyproject.toml)."""
