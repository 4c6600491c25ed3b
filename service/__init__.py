"""convserve's service layer, a folder per process: frontend/ (the HTTP front ends), worker/ (a
model worker per device), cli/ (the `convserve` command) and supervisor.py (the `serve` process
that runs the rest); shared by them: codecs/ (wire formats), ipc/ (what crosses between
processes), settings, problems, metrics, per-model statistics and a served model's view
(hosted_model.py). docs/service-architecture.md has the table."""
