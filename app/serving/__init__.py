"""Serving: what runs next is decided in the HTTP front end, how it runs in model workers.

front end (HTTP process, no torch)            |  worker processes (NMT_REPLICAS), each
                                              |    serving every model
router.Router: (source, target) -> a model,   |
  or two through English                      |
pipeline.Translation: a request's sentences   |
  along their routes, hop after hop           |
scheduler.Scheduler: admission, a queue per   |
  model (ModelQueue), workers shared by all   |
  models, fair order,                    -----+->  worker: the pipe, the inbox, the loop
  deadlines, retries                          |    models.ModelTable: models loaded on demand, LRU
handle.WorkerProcess: a worker's handle       |    executor.Executor: a running batch per model,
                                              |      cache slots, models stepping in turn
               protocol: the messages on the pipe, imported by both sides
"""
