// The reference server for bench/receiver_bench.py: stock @tus/server 2 with its FileStore.
//
//   node tus_server.js --port PORT --dir DIRECTORY [--host 127.0.0.1]
//
// Serves tus 1.0.0 at /files/ on 127.0.0.1:PORT and stores uploads in DIRECTORY.  No checksum,
// no fsync: this is what a plain tus server costs, the baseline canner is compared against.
// Prints "listening HOST:PORT" once ready; stops on SIGTERM or SIGINT.
import { FileStore } from "@tus/file-store";
import { Server } from "@tus/server";

function option(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  if (i >= 0 && i + 1 < process.argv.length) return process.argv[i + 1];
  if (fallback === undefined) {
    console.error(`usage: node tus_server.js --port PORT --dir DIRECTORY [--host HOST]`);
    process.exit(2);
  }
  return fallback;
}

const host = option("host", "127.0.0.1");
const port = Number(option("port"));
const directory = option("dir");

const tus = new Server({
  path: "/files",
  datastore: new FileStore({ directory }),
  relativeLocation: true,
});

const server = tus.listen({ host, port }, () => {
  console.log(`listening ${host}:${port}`);
});
server.keepAliveTimeout = 60_000;
server.requestTimeout = 0; // a 1 GiB PATCH may take longer than the 300 s default

function stop() {
  server.close(() => process.exit(0));
  server.closeAllConnections?.();
  setTimeout(() => process.exit(0), 2000).unref();
}
process.on("SIGTERM", stop);
process.on("SIGINT", stop);
