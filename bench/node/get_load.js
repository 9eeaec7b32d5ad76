// Closed-loop GET load for bench/hq_bench.py: `node get_load.js CONFIG.json`.
//
// CONFIG: {base: "http://127.0.0.1:PORT", paths: [...], concurrency: N, seconds: S}
// Each of `concurrency` keep-alive loops GETs paths round-robin (offset per loop) until `seconds`
// have passed.  Prints one JSON line: {requests, errors, seconds, p50_ms, p99_ms}.
import { readFileSync } from "node:fs";
import http from "node:http";
import { performance } from "node:perf_hooks";

const config = JSON.parse(readFileSync(process.argv[2], "utf8"));
const agent = new http.Agent({ keepAlive: true, maxSockets: config.concurrency });
const base = new URL(config.base);
const latencies = [];
let errors = 0;
const started = performance.now();
const until = started + config.seconds * 1000;

function get(path) {
  return new Promise((resolve) => {
    const t0 = performance.now();
    const req = http.get(
      { host: base.hostname, port: base.port, path, agent },
      (res) => {
        res.on("data", () => {});
        res.on("end", () => {
          if (res.statusCode !== 200) errors += 1;
          latencies.push(performance.now() - t0);
          resolve();
        });
      },
    );
    req.on("error", () => {
      errors += 1;
      resolve();
    });
  });
}

async function loop(offset) {
  let i = offset;
  while (performance.now() < until) {
    await get(config.paths[i % config.paths.length]);
    i += config.concurrency;
  }
}

await Promise.all([...Array(config.concurrency).keys()].map(loop));
const seconds = (performance.now() - started) / 1000;
latencies.sort((a, b) => a - b);
const pick = (q) => latencies[Math.min(latencies.length - 1, Math.floor(q * latencies.length))];
console.log(
  JSON.stringify({
    requests: latencies.length,
    errors,
    seconds,
    p50_ms: pick(0.5),
    p99_ms: pick(0.99),
  }),
);
agent.destroy();
