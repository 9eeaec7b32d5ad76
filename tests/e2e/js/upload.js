#!/usr/bin/env node
// Upload one file to canner with tus-js-client and print what a worker would keep, as JSON:
//
//   node upload.js ENDPOINT FILE PROJECT CHECKSUM [--chunk-size N] [--data-during-creation]
//                  [--filename NAME]
//
// Output (stdout, one JSON object): {"url": upload URL, "receipt": the Artifact-Receipt header of
// the last response (via onAfterResponse), "lastResponseReceipt": the same header read from
// onSuccess's lastResponse, "responses": [{method, status, offset, receipt}, ...]}.
// On failure: {"error": message, "responses": [...]} and exit status 1.
'use strict'

const fs = require('fs')
const tus = require('tus-js-client')

function parseArgs(argv) {
  const [endpoint, file, project, checksum, ...rest] = argv
  if (!endpoint || !file || !project || !checksum) {
    console.error('usage: upload.js ENDPOINT FILE PROJECT CHECKSUM [options]')
    process.exit(2)
  }
  const opts = { endpoint, file, project, checksum, chunkSize: Infinity, dataDuringCreation: false }
  for (let i = 0; i < rest.length; i++) {
    if (rest[i] === '--chunk-size') opts.chunkSize = Number(rest[++i])
    else if (rest[i] === '--data-during-creation') opts.dataDuringCreation = true
    else if (rest[i] === '--filename') opts.filename = rest[++i]
    else {
      console.error(`unknown option ${rest[i]}`)
      process.exit(2)
    }
  }
  return opts
}

function main() {
  const opts = parseArgs(process.argv.slice(2))
  const data = fs.readFileSync(opts.file)
  const responses = []
  const metadata = { project: opts.project, checksum: opts.checksum }
  if (opts.filename !== undefined) metadata.filename = opts.filename

  const upload = new tus.Upload(data, {
    endpoint: opts.endpoint,
    metadata,
    chunkSize: opts.chunkSize,
    uploadDataDuringCreation: opts.dataDuringCreation,
    retryDelays: null,
    onAfterResponse(req, res) {
      responses.push({
        method: req.getMethod(),
        status: res.getStatus(),
        offset: res.getHeader('Upload-Offset') ?? null,
        receipt: res.getHeader('Artifact-Receipt') ?? null,
        tusResumable: res.getHeader('Tus-Resumable') ?? null,
      })
    },
    onSuccess({ lastResponse }) {
      const last = responses[responses.length - 1]
      process.stdout.write(
        JSON.stringify({
          url: upload.url,
          receipt: last ? last.receipt : null,
          lastResponseReceipt: lastResponse ? lastResponse.getHeader('Artifact-Receipt') ?? null : null,
          responses,
        }) + '\n',
      )
    },
    onError(err) {
      process.stdout.write(JSON.stringify({ error: String(err), responses }) + '\n')
      process.exitCode = 1
    },
  })
  upload.start()
}

main()
