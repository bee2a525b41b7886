// TLS and SASL settings: mapped onto kafkajs as the worker's SPANGUARD_KAFKA_* say, refused when
// they cannot work together (the same refusals as config/kafka_security.py).
import assert from 'node:assert/strict';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';

import { KafkaSecurityError, kafkajsSecurity, securityFromEnv } from '../src/index.js';

const folder = mkdtempSync(join(tmpdir(), 'spanguard-security-'));
const ca = join(folder, 'ca.pem');
writeFileSync(ca, '-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n');
const passwordFile = join(folder, 'password');
writeFileSync(passwordFile, 's3cret-never-logged\n');

test('plaintext maps to nothing', () => {
  assert.deepEqual(kafkajsSecurity(securityFromEnv({})), {});
});

test('SASL_SSL with SCRAM from the environment, the password from a file', () => {
  const security = securityFromEnv({
    SPANGUARD_KAFKA_SECURITY_PROTOCOL: 'sasl_ssl',
    SPANGUARD_KAFKA_SASL_MECHANISM: 'SCRAM-SHA-512',
    SPANGUARD_KAFKA_SASL_USERNAME: 'agent',
    SPANGUARD_KAFKA_SASL_PASSWORD_FILE: passwordFile,
    SPANGUARD_KAFKA_SSL_CA_LOCATION: ca,
  });
  const options = kafkajsSecurity(security);
  assert.deepEqual(options.sasl, { mechanism: 'scram-sha-512', username: 'agent', password: 's3cret-never-logged' });
  assert.equal(options.ssl.rejectUnauthorized, true);
  assert.equal(options.ssl.ca.length, 1);
  assert.equal(options.ssl.checkServerIdentity, undefined); // names are checked by default
});

test('endpoint identification none skips the name check only', () => {
  const options = kafkajsSecurity({ securityProtocol: 'SSL', sslCaLocation: ca, sslEndpointIdentificationAlgorithm: 'none' });
  assert.equal(options.ssl.rejectUnauthorized, true);
  assert.equal(options.ssl.checkServerIdentity(), undefined);
});

for (const [name, security, message] of [
  ['an unknown protocol', { securityProtocol: 'TLS' }, /security.protocol must be one of/],
  ['SASL without a mechanism', { securityProtocol: 'SASL_SSL', saslUsername: 'u', saslPassword: 'p' }, /needs sasl.mechanism/],
  ['SASL without a password', { securityProtocol: 'SASL_PLAINTEXT', saslMechanism: 'PLAIN', saslUsername: 'u' }, /needs sasl.password/],
  ['a SASL mechanism over PLAINTEXT', { securityProtocol: 'PLAINTEXT', saslMechanism: 'PLAIN' }, /use SASL_SSL/],
  ['a CA over PLAINTEXT', { securityProtocol: 'PLAINTEXT', sslCaLocation: ca }, /use SSL or SASL_SSL/],
  ['a certificate without its key', { securityProtocol: 'SSL', sslCertificateLocation: ca }, /go together/],
  ['a CA file that is not there', { securityProtocol: 'SSL', sslCaLocation: join(folder, 'nope.pem') }, /no such file/],
]) {
  test(`refused: ${name}`, () => {
    assert.throws(() => kafkajsSecurity(security), (error) => error instanceof KafkaSecurityError && message.test(error.message) && !error.message.includes('s3cret'));
  });
}
