"""The model worker process, one per device (model_worker.py; the supervisor starts it): what it
holds for its device (model_host.py: backend, models, batcher), loading and warming up the models
(loading.py), the batcher, recovery from running out of device memory, streamed decodes' state,
injected faults, and a decode split over several devices (shard_leader.py on the first device's
worker, shard_member.py on the others; shard_group.py: the same split as a standalone group of
processes, for `convserve decode --shards`)."""
