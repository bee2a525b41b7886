// TLS and SASL for the kill-topic consumer, from the same SPANGUARD_KAFKA_* variables the worker
// and the Python killswitch read (config/kafka_security.py), with the same refusals: settings
// that cannot work together throw before any connection.

import { readFileSync } from 'node:fs';

const PROTOCOLS = ['PLAINTEXT', 'SSL', 'SASL_PLAINTEXT', 'SASL_SSL'];
const MECHANISMS = { PLAIN: 'plain', 'SCRAM-SHA-256': 'scram-sha-256', 'SCRAM-SHA-512': 'scram-sha-512' };

export class KafkaSecurityError extends Error {}

function secret(environ, name) {
  const value = environ[name];
  if (value) return value;
  const file = environ[`${name}_FILE`];
  if (!file) return undefined;
  try {
    return readFileSync(file, 'utf8').replace(/\r?\n$/, '');
  } catch {
    throw new KafkaSecurityError(`${name}_FILE: cannot read ${JSON.stringify(file)}`);
  }
}

/** Security settings from an environment (default process.env). */
export function securityFromEnv(environ = process.env) {
  const get = (name) => environ[`SPANGUARD_KAFKA_${name}`] || undefined;
  return {
    securityProtocol: get('SECURITY_PROTOCOL') ?? 'PLAINTEXT',
    sslCaLocation: get('SSL_CA_LOCATION'),
    sslCertificateLocation: get('SSL_CERTIFICATE_LOCATION'),
    sslKeyLocation: get('SSL_KEY_LOCATION'),
    sslKeyPassword: secret(environ, 'SPANGUARD_KAFKA_SSL_KEY_PASSWORD'),
    sslEndpointIdentificationAlgorithm: get('SSL_ENDPOINT_IDENTIFICATION_ALGORITHM') ?? 'https',
    saslMechanism: get('SASL_MECHANISM'),
    saslUsername: get('SASL_USERNAME'),
    saslPassword: secret(environ, 'SPANGUARD_KAFKA_SASL_PASSWORD'),
  };
}

function readPem(what, path) {
  try {
    return readFileSync(path, 'utf8');
  } catch {
    throw new KafkaSecurityError(`${what}: no such file ${JSON.stringify(path)}`);
  }
}

/** kafkajs's `ssl` and `sasl` options for `security` (see securityFromEnv); throws
 * KafkaSecurityError for settings that cannot work together. Passwords are never logged. */
export function kafkajsSecurity(security) {
  const protocol = String(security.securityProtocol ?? 'PLAINTEXT').trim().toUpperCase();
  if (!PROTOCOLS.includes(protocol)) {
    throw new KafkaSecurityError(`security.protocol must be one of ${PROTOCOLS.join(', ')}, not ${JSON.stringify(protocol)}`);
  }
  const usesSasl = protocol.startsWith('SASL_');
  const usesTls = protocol === 'SSL' || protocol === 'SASL_SSL';
  const options = {};
  if (usesSasl) {
    const mechanism = MECHANISMS[String(security.saslMechanism ?? '').trim().toUpperCase()];
    if (mechanism === undefined) {
      throw new KafkaSecurityError(`security.protocol ${protocol} needs sasl.mechanism, one of ${Object.keys(MECHANISMS).join(', ')}`);
    }
    if (!security.saslUsername) throw new KafkaSecurityError(`security.protocol ${protocol} needs sasl.username`);
    if (!security.saslPassword) throw new KafkaSecurityError(`security.protocol ${protocol} needs sasl.password`);
    options.sasl = { mechanism, username: security.saslUsername, password: security.saslPassword };
  } else if (security.saslMechanism || security.saslUsername || security.saslPassword) {
    throw new KafkaSecurityError(`SASL settings are set but security.protocol is ${protocol}: use SASL_SSL (or SASL_PLAINTEXT)`);
  }
  const tlsFiles = [security.sslCaLocation, security.sslCertificateLocation, security.sslKeyLocation, security.sslKeyPassword];
  if (!usesTls) {
    if (tlsFiles.some(Boolean)) throw new KafkaSecurityError(`TLS settings are set but security.protocol is ${protocol}: use SSL or SASL_SSL`);
    return options;
  }
  if (Boolean(security.sslCertificateLocation) !== Boolean(security.sslKeyLocation)) {
    throw new KafkaSecurityError('ssl.certificate.location and ssl.key.location go together (mutual TLS): set both or neither');
  }
  if (security.sslKeyPassword && !security.sslKeyLocation) {
    throw new KafkaSecurityError('ssl.key.password is set without ssl.key.location');
  }
  const algorithm = String(security.sslEndpointIdentificationAlgorithm ?? 'https').toLowerCase();
  if (algorithm !== 'https' && algorithm !== 'none') {
    throw new KafkaSecurityError(`ssl.endpoint.identification.algorithm must be https or none, not ${JSON.stringify(algorithm)}`);
  }
  const ssl = { rejectUnauthorized: true };
  if (security.sslCaLocation) ssl.ca = [readPem('ssl.ca.location', security.sslCaLocation)];
  if (security.sslCertificateLocation) {
    ssl.cert = readPem('ssl.certificate.location', security.sslCertificateLocation);
    ssl.key = readPem('ssl.key.location', security.sslKeyLocation);
    if (security.sslKeyPassword) ssl.passphrase = security.sslKeyPassword;
  }
  // "none" skips the name check only; the certificate chain is still verified.
  if (algorithm === 'none') ssl.checkServerIdentity = () => undefined;
  options.ssl = ssl;
  return options;
}
