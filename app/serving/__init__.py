"""Serving: what runs next is decided in the HTTP front end, how it runs in model workers.

front end (HTTP process)                 |  worker processes (NMT_REPLICAS)
scheduler.Scheduler: admission, queue,   |  worker: the pipe, the inbox, the loop
  fair order, deadlines, retries  -------+->  executor.Executor: running batch, cache slots,
worker.WorkerProcess: a worker's handle  |      one decoding step at a time
"""
