#!/usr/bin/env node
// Upload many files with tus-js-client from one process (a node start per file costs more
// than the upload), a few at a time, and print one JSON line per file:
//
//   node upload_many.js ENDPOINT MANIFEST [--concurrency N]
//
// MANIFEST is a JSON list of {"file", "project", "checksum", "filename", "chunkSize"}.
// Output lines: {"file", "url", "receipt"} or {"file", "error"}; exit status 1 if any failed.
'use strict'

const fs = require('fs')
const tus = require('tus-js-client')

function uploadOne(endpoint, item) {
  return new Promise((resolve) => {
    const data = fs.readFileSync(item.file)
    let receipt = null
    const metadata = { project: item.project, checksum: item.checksum }
    if (item.filename) metadata.filename = item.filename
    const upload = new tus.Upload(data, {
      endpoint,
      metadata,
      chunkSize: item.chunkSize || Infinity,
      retryDelays: null,
      onAfterResponse(req, res) {
        receipt = res.getHeader('Artifact-Receipt') ?? receipt
      },
      onSuccess() {
        resolve({ file: item.file, url: upload.url, receipt })
      },
      onError(err) {
        resolve({ file: item.file, error: String(err) })
      },
    })
    upload.start()
  })
}

async function main() {
  const [endpoint, manifest, ...rest] = process.argv.slice(2)
  if (!endpoint || !manifest) {
    console.error('usage: upload_many.js ENDPOINT MANIFEST [--concurrency N]')
    process.exit(2)
  }
  let concurrency = 4
  if (rest[0] === '--concurrency') concurrency = Number(rest[1])
  const items = JSON.parse(fs.readFileSync(manifest, 'utf8'))
  let next = 0
  let failed = 0
  async function worker() {
    while (next < items.length) {
      const result = await uploadOne(endpoint, items[next++])
      if (result.error) failed++
      process.stdout.write(JSON.stringify(result) + '\n')
    }
  }
  await Promise.all(Array.from({ length: concurrency }, worker))
  process.exitCode = failed ? 1 : 0
}

main()
