// index.d.ts declares what index.js exports, no more and no less: tsc checks the declarations
// and types-test/usage.ts against each other (npm run typecheck), not against the JavaScript,
// so a value exported but not declared, or declared but gone, is caught here.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';

import ts from 'typescript';

import * as killswitch from '../src/index.js';

function declaredValues() {
  const path = new URL('../src/index.d.ts', import.meta.url);
  const source = ts.createSourceFile('index.d.ts', readFileSync(path, 'utf8'), ts.ScriptTarget.Latest);
  const names = new Set();
  for (const statement of source.statements) {
    const exported = ts.getModifiers?.(statement)?.some((m) => m.kind === ts.SyntaxKind.ExportKeyword);
    if (!exported) continue;
    if (ts.isVariableStatement(statement)) {
      for (const declaration of statement.declarationList.declarations) names.add(declaration.name.text);
    } else if (ts.isClassDeclaration(statement) || ts.isFunctionDeclaration(statement)) {
      names.add(statement.name.text); // (interfaces and type aliases are types only)
    }
  }
  return names;
}

test('index.d.ts declares every value index.js exports, and nothing else', () => {
  assert.deepEqual([...declaredValues()].sort(), Object.keys(killswitch).sort());
});
