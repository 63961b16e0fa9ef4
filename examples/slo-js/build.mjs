// Build the policy component: node build.mjs [OUTPUT].
//
// package.json's "switchyard" field says where things are, relative to this directory: the
// policy module (`source`), the contract (`wit`) and the default OUTPUT (`output`). The same
// script builds this example and every project `switchyard policy new --lang js` writes.
//
// Calls componentize-js's library API rather than `jco componentize`, whose WASI-sandboxed
// CLI cannot read the WIT file from outside its preopened directory on some machines.

import { componentize } from '@bytecodealliance/componentize-js';
import { mkdir, readFile, rename, writeFile } from 'node:fs/promises';
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const manifest = JSON.parse(await readFile(resolve(here, 'package.json'), 'utf8'));
const paths = manifest.switchyard;
const output = resolve(process.argv[2] ?? resolve(here, paths.output));

const { component } = await componentize({
  sourcePath: resolve(here, paths.source),
  witPath: resolve(here, paths.wit),
  worldName: 'policy',
  // The router gives guests no network; leave out the engine's fetch support.
  disableFeatures: ['http', 'fetch-event'],
});

// Write then rename: the router's plugin watcher must never read half a file.
await mkdir(dirname(output), { recursive: true });
const partial = `${output}.partial`;
await writeFile(partial, component);
await rename(partial, output);
console.log(`built ${output} (${component.length} bytes)`);
