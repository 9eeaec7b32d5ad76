// The one load generator bench/receiver_bench.py drives against both servers.
//
//   node load.js CONFIG.json
//
// Each upload is a tus creation POST (Upload-Length + Upload-Metadata) followed by PATCHes
// (one streamed PATCH for the whole body unless `patchSize` says otherwise).  Bodies are slices of
// a pre-generated random pool file, written from memory in `chunk`-sized pieces with
// backpressure, so the client does no per-byte work besides the socket writes.  Prints one JSON
// document on stdout: wall time, per-upload latencies, failures, the client's own CPU time, and
// (with `headProbe`) HEAD latencies measured while the server finishes a large upload.
//
// CONFIG fields:
//   base            "http://127.0.0.1:PORT/files/"
//   pool            path of the random pool file; upload i sends pool bytes from uploads[i].offset,
//                   wrapping around, for uploads[i].size bytes
//   uploads         [{offset, size, checksum}], checksum = "blake3:<hex>" of exactly those bytes
//   concurrency     uploads in flight at once
//   patchSize       bytes per PATCH (0 = the whole body in one PATCH)
//   chunk           bytes per socket write
//   project         Upload-Metadata project
//   expectReceipt   true: the final PATCH must carry a valid Artifact-Receipt (canner)
//   timeoutMs       hard limit for the whole run; unfinished uploads count as failures
//   put             true: each upload is one PUT of the whole body to base + file name (canner's
//                   seesaw target), answered 201 with the receipt; no tus creation, no PATCH
//   headProbe       optional {intervalMs, baseline}: needs exactly one upload; HEADs another
//                   (never completed) upload every intervalMs, open loop, while the final PATCH
//                   body is in flight ("body") and from the moment it is sent until its response
//                   ("finalize"); `baseline` HEADs against the idle server first ("idle").
import { readFileSync } from "node:fs";
import http from "node:http";
import { performance } from "node:perf_hooks";

const config = JSON.parse(readFileSync(process.argv[2], "utf8"));
const base = new URL(config.base);
const pool = readFileSync(config.pool);
const chunkSize = config.chunk || 1 << 20;
const concurrency = Math.max(1, config.concurrency || 1);

const uploadAgent = new http.Agent({ keepAlive: true, maxSockets: concurrency });
const probeAgent = new http.Agent({ keepAlive: true, maxSockets: 16 });

const b64 = (text) => Buffer.from(text, "utf8").toString("base64");

function metadataHeader(pairs) {
  return Object.entries(pairs)
    .map(([k, v]) => `${k} ${b64(v)}`)
    .join(",");
}

// One HTTP exchange.  `body(req)` writes the request body and ends the request; it may return a
// promise.  Resolves with {status, headers, sentAt, doneAt}; `sentAt` is when the whole request
// had been handed to the kernel ('finish').
function exchange(agent, method, url, headers, body, onSent) {
  return new Promise((resolve, reject) => {
    const req = http.request(url, { method, agent, headers });
    let sentAt = null;
    req.on("finish", () => {
      sentAt = performance.now();
      if (onSent) onSent(sentAt);
    });
    req.on("error", reject);
    req.on("response", (res) => {
      const chunks = [];
      res.on("data", (c) => chunks.push(c));
      res.on("error", reject);
      res.on("end", () =>
        resolve({
          status: res.statusCode,
          headers: res.headers,
          body: Buffer.concat(chunks).toString("utf8").slice(0, 500),
          sentAt,
          doneAt: performance.now(),
        }),
      );
    });
    if (body) body(req);
    else req.end();
  });
}

// Write `size` pool bytes starting at pool offset `start` (wrapping), honouring backpressure.
function streamBody(req, start, size) {
  let sent = 0;
  let pos = start % pool.length;
  const pump = () => {
    while (sent < size) {
      const n = Math.min(chunkSize, size - sent, pool.length - pos);
      const piece = pool.subarray(pos, pos + n);
      sent += n;
      pos = (pos + n) % pool.length;
      if (sent === size) {
        req.end(piece);
        return;
      }
      if (!req.write(piece)) {
        req.once("drain", pump);
        return;
      }
    }
    req.end();
  };
  pump();
}

function checkReceipt(header, objectId, upload) {
  if (!header) return "no Artifact-Receipt on the final response";
  let receipt;
  try {
    receipt = JSON.parse(Buffer.from(header, "base64url").toString("utf8"));
  } catch (e) {
    return `Artifact-Receipt does not decode: ${e.message}`;
  }
  if (receipt.object_id !== objectId) return `receipt object_id ${receipt.object_id} != ${objectId}`;
  if (receipt.checksum !== upload.checksum) return `receipt checksum ${receipt.checksum} differs`;
  if (receipt.size_bytes !== upload.size) return `receipt size ${receipt.size_bytes} != ${upload.size}`;
  return null;
}

async function create(size, checksum, filename) {
  const headers = {
    "Tus-Resumable": "1.0.0",
    "Upload-Length": String(size),
    "Upload-Metadata": metadataHeader({ project: config.project, checksum, filename }),
    "Content-Length": "0",
  };
  const r = await exchange(uploadAgent, "POST", base, headers);
  if (r.status !== 201 || !r.headers.location) {
    throw new Error(`POST answered ${r.status}: ${r.body.trim()}`);
  }
  return new URL(r.headers.location, base);
}

// One whole upload as a single PUT (what seesaw's curl sends); the receipt names the stored bytes'
// BLAKE3, which must be the spec's.
async function put(index, spec, rec) {
  const url = new URL(`bench-${index}.bin`, base);
  const headers = { "Content-Length": String(spec.size), "Content-Type": "application/octet-stream" };
  const r = await exchange(uploadAgent, "PUT", url, headers, (req) => streamBody(req, spec.offset, spec.size));
  if (r.status !== 201) throw new Error(`PUT answered ${r.status}: ${r.body.trim()}`);
  rec.finalSentAt = r.sentAt;
  rec.end = r.doneAt;
  const header = r.headers["artifact-receipt"];
  const objectId = header ? JSON.parse(Buffer.from(header, "base64url").toString("utf8")).object_id : "";
  const problem = checkReceipt(header, objectId, spec);
  if (problem) throw new Error(problem);
}

// One whole upload; returns a result record, never throws.
async function upload(index, spec, hooks = {}) {
  const rec = { index, size: spec.size, ok: false, start: performance.now() };
  if (config.put) {
    try {
      await put(index, spec, rec);
      rec.ok = true;
    } catch (e) {
      rec.error = String(e.message || e);
      rec.end = performance.now();
    }
    return rec;
  }
  try {
    const url = await create(spec.size, spec.checksum, `bench-${index}.bin`);
    rec.createdAt = performance.now();
    const objectId = url.pathname.split("/").pop();
    rec.objectId = objectId;
    const patchSize = config.patchSize > 0 ? config.patchSize : spec.size;
    let offset = 0;
    let last = null;
    while (offset < spec.size) {
      const n = Math.min(patchSize, spec.size - offset);
      const final = offset + n === spec.size;
      const headers = {
        "Tus-Resumable": "1.0.0",
        "Upload-Offset": String(offset),
        "Content-Type": "application/offset+octet-stream",
        "Content-Length": String(n),
      };
      if (final && hooks.onFinalStart) hooks.onFinalStart();
      const from = spec.offset + offset;
      last = await exchange(
        uploadAgent,
        "PATCH",
        url,
        headers,
        (req) => streamBody(req, from, n),
        final ? hooks.onFinalSent : undefined,
      );
      if (last.status !== 204) throw new Error(`PATCH answered ${last.status}: ${last.body.trim()}`);
      const got = last.headers["upload-offset"];
      if (got !== String(offset + n)) throw new Error(`PATCH Upload-Offset ${got}, expected ${offset + n}`);
      offset += n;
    }
    rec.finalSentAt = last.sentAt;
    rec.end = last.doneAt;
    if (config.expectReceipt) {
      const problem = checkReceipt(last.headers["artifact-receipt"], rec.objectId, spec);
      if (problem) throw new Error(problem);
    }
    rec.ok = true;
  } catch (e) {
    rec.error = String(e.message || e);
    rec.end = performance.now();
  }
  return rec;
}

async function runUploads(hooks) {
  const results = new Array(config.uploads.length);
  let next = 0;
  const worker = async () => {
    while (next < config.uploads.length) {
      const i = next++;
      results[i] = await upload(i, config.uploads[i], hooks);
    }
  };
  await Promise.all(Array.from({ length: Math.min(concurrency, config.uploads.length) }, worker));
  return results;
}

// Open-loop HEAD prober: a HEAD every intervalMs whether or not the previous one answered, so a
// stalled server shows up as long latencies rather than as fewer samples.
function startProber(url, intervalMs) {
  const samples = [];
  const errors = [];
  const inflight = new Set();
  const fire = () => {
    const t0 = performance.now();
    const p = exchange(probeAgent, "HEAD", url, { "Tus-Resumable": "1.0.0" })
      .then((r) => {
        if (r.status !== 200) errors.push(`HEAD answered ${r.status}`);
        else samples.push(r.doneAt - t0);
      })
      .catch((e) => errors.push(String(e.message || e)))
      .finally(() => inflight.delete(p));
    inflight.add(p);
  };
  fire();
  const timer = setInterval(fire, intervalMs);
  return async () => {
    clearInterval(timer);
    await Promise.all([...inflight]);
    return { samples, errors };
  };
}

async function headProbe(probe) {
  // A one-byte upload that is never completed: HEAD reads its sidecar and offset.
  const target = await create(1, config.probeChecksum, "probe.bin");
  const out = { idle: null, body: null, finalize: null };
  const idle = [];
  for (let i = 0; i < (probe.baseline || 0); i++) {
    const t0 = performance.now();
    const r = await exchange(probeAgent, "HEAD", target, { "Tus-Resumable": "1.0.0" });
    if (r.status === 200) idle.push(r.doneAt - t0);
    await new Promise((res) => setTimeout(res, probe.intervalMs));
  }
  out.idle = { samples: idle, errors: [] };
  let stopBody = null;
  let stopFinal = null;
  const hooks = {
    onFinalStart: () => {
      stopBody = startProber(target, probe.intervalMs);
    },
    onFinalSent: () => {
      const ending = stopBody;
      stopBody = null;
      if (ending) ending().then((r) => (out.body = r));
      stopFinal = startProber(target, probe.intervalMs);
    },
  };
  const results = await runUploads(hooks);
  if (stopBody) out.body = await stopBody();
  if (stopFinal) out.finalize = await stopFinal();
  while (out.body === null) await new Promise((res) => setTimeout(res, 10));
  return { results, probe: out };
}

async function main() {
  const cpu0 = process.cpuUsage();
  const t0 = performance.now();
  let finished = false;
  const timer = setTimeout(() => {
    if (finished) return;
    const wall = (performance.now() - t0) / 1000;
    process.stdout.write(`${JSON.stringify({ timedOut: true, wallSeconds: wall })}\n`);
    process.exit(3);
  }, config.timeoutMs);
  let results;
  let probe = null;
  if (config.headProbe) {
    ({ results, probe } = await headProbe(config.headProbe));
  } else {
    results = await runUploads({});
  }
  finished = true;
  clearTimeout(timer);
  const cpu = process.cpuUsage(cpu0);
  const first = Math.min(...results.map((r) => r.start));
  const lastEnd = Math.max(...results.map((r) => r.end));
  const failures = results.filter((r) => !r.ok);
  const summary = {
    timedOut: false,
    uploads: results.length,
    ok: results.length - failures.length,
    failures: failures.length,
    failureSamples: failures.slice(0, 5).map((r) => `#${r.index}: ${r.error}`),
    bytes: results.filter((r) => r.ok).reduce((a, r) => a + r.size, 0),
    wallSeconds: (lastEnd - first) / 1000,
    runSeconds: (performance.now() - t0) / 1000,
    latenciesMs: results.filter((r) => r.ok).map((r) => r.end - r.start),
    // From the last body byte handed to the kernel to the final response: the server's
    // completion work (for canner: fsync, BLAKE3 over the file, receipt).
    finalizeMs: results.filter((r) => r.ok && r.finalSentAt).map((r) => r.end - r.finalSentAt),
    // The creation POST alone, from its start to its 201 (tus only).
    creationMs: results.filter((r) => r.ok && r.createdAt).map((r) => r.createdAt - r.start),
    clientCpuUserSeconds: cpu.user / 1e6,
    clientCpuSystemSeconds: cpu.system / 1e6,
    clientMaxRssKiB: process.resourceUsage().maxRSS,
    probe,
  };
  process.stdout.write(`${JSON.stringify(summary)}\n`);
  uploadAgent.destroy();
  probeAgent.destroy();
}

main().catch((e) => {
  process.stdout.write(`${JSON.stringify({ timedOut: false, fatal: String(e.stack || e) })}\n`);
  process.exit(1);
});
