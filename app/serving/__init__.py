"""Serving: what runs next is decided in the HTTP front end, how it runs in model workers.

frontend/ (HTTP process, no torch)            |  worker/ (NMT_REPLICAS workers, each serving
                                              |    every model, threads of NMT_WORKER_PROCESSES
                                              |    processes; a model's weights once a process)
router.Router: (source, target) -> a model,   |
  or two through English                      |
pipeline.Translation: a request's sentences   |
  along their routes, hop after hop           |
scheduler.Scheduler: admission, a queue per   |
  model (ModelQueue), workers shared by all   |
  models, fair order,                    -----+->  process: the pipe, the loop
  deadlines, retries                          |    inbox.Inbox: what waits, fair order per model
handle.WorkerProcess: a process, started by   |    models.ModelTable: models loaded on demand, LRU
  name (WORKER_ENTRY); WorkerThread: a worker |    executor.Executor: a running batch per model,
                                              |      cache slots, models stepping in turn
     shared, torch-free, imported by both rooms: protocol (the messages on the pipe), errors,
     fairqueue, cores. Neither room imports the other (pyproject.toml's import-linter contracts).
"""
