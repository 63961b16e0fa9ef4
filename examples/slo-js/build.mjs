// Build the policy component: node build.mjs [OUTPUT] (default ../../target/examples/slo-js.wasm).
//
// Calls componentize-js's library API rather than `jco componentize`, whose WASI-sandboxed
// CLI cannot read the WIT file from outside its preopened directory on some machines.

import { componentize } from '@bytecodealliance/componentize-js';
import { mkdir, rename, writeFile } from 'node:fs/promises';
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const output = resolve(process.argv[2] ?? resolve(here, '../../target/examples/slo-js.wasm'));

const { component } = await componentize({
  sourcePath: resolve(here, 'src/policy.js'),
  witPath: resolve(here, '../../wit/policy.wit'),
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
