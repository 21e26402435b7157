-- wrk script for GET of many paths (benchmarks/job_polls.py: each job's /jobs/{id}): the paths, one
-- per line, from the file named by WRK_PATHS, taken in turn from a random start per thread; answers
-- counted by status; 503 answers without Retry-After counted; a one-line JSON summary at the end.

local paths = {}
local next_path = 0
statuses = {}
busy_without_retry_after = 0
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  for line in io.lines(os.getenv("WRK_PATHS")) do
    if #line > 0 then table.insert(paths, line) end
  end
  math.randomseed(os.time() + #threads * 7919 + math.floor(os.clock() * 1e6))
  next_path = math.random(#paths)
  wrk.method = "GET"
end

function request()
  next_path = next_path % #paths + 1
  return wrk.format(nil, paths[next_path])
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
