"""Serving: what runs next is decided in the HTTP front end, how it runs in model workers.

front end (HTTP process, no torch)            |  worker processes (NMT_REPLICAS per model)
router.Router: (source, target) -> a model,   |
  or two through English                      |
pipeline.Translation: a request's sentences   |
  along their routes, hop after hop           |
scheduler.Scheduler: admission, a queue and   |
  workers per model (Pool), fair order,  -----+->  worker: the pipe, the inbox, the loop
  deadlines, retries                          |    executor.Executor: running batch, cache slots,
handle.WorkerProcess: a worker's handle       |      one decoding step at a time
               protocol: the messages on the pipe, imported by both sides
"""
