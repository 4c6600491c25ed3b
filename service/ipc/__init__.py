"""What crosses between the service's processes, shared by all of them: the shared-memory arena
tensors travel in (shm.py), the typed messages on the workers' Unix sockets (worker_protocol.py),
the one table of why a request failed (worker_errors.py) and a model worker's heartbeat record
(heartbeat.py). Nothing here imports a front end's or a worker's own modules."""
