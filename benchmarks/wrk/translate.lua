-- wrk script for POST /translate (benchmarks/load.py): request bodies, one JSON per line, from the
-- file named by WRK_BODIES, taken in turn from a random start per thread; or, with WRK_PATHS
-- instead, GET of the paths in that file, one per line (benchmarks/job_polls.py: each job's
-- /jobs/{id}). Answers counted by status; 503 answers without Retry-After counted; a one-line JSON
-- summary printed at the end.

local bodies = {}
local next_body = 0
statuses = {}
busy_without_retry_after = 0
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

local gets = os.getenv("WRK_PATHS") ~= nil

function init(args)
  for line in io.lines(os.getenv(gets and "WRK_PATHS" or "WRK_BODIES")) do
    if #line > 0 then table.insert(bodies, line) end
  end
  math.randomseed(os.time() + #threads * 7919 + math.floor(os.clock() * 1e6))
  next_body = math.random(#bodies)
  if gets then
    wrk.method = "GET"
  else
    wrk.method = "POST"
    wrk.headers["Content-Type"] = "application/json"
  end
end

function request()
  next_body = next_body % #bodies + 1
  if gets then
    return wrk.format(nil, bodies[next_body])
  end
  return wrk.format(nil, "/translate", nil, bodies[next_body])
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
  if status == 503 and headers["Retry-After"] == nil and headers["retry-after"] == nil then
    busy_without_retry_after = busy_without_retry_after + 1
  end
end

function done(summary, latency, requests)
  local total, busy = {}, 0
  for _, thread in ipairs(threads) do
    for status, n in pairs(thread:get("statuses")) do
      total[status] = (total[status] or 0) + n
    end
    busy = busy + thread:get("busy_without_retry_after")
  end
  local parts = {}
  for status, n in pairs(total) do
    table.insert(parts, string.format('"%d": %d', status, n))
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"duration_us": %d, "requests": %d, "statuses": {%s}, "busy_without_retry_after": %d, ' ..
    '"errors": {"connect": %d, "read": %d, "write": %d, "timeout": %d}, ' ..
    '"latency_us": {"p50": %d, "p90": %d, "p99": %d, "max": %d}}\n',
    summary.duration, summary.requests, table.concat(parts, ", "), busy,
    e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
