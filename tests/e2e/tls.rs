//! TLS on both sides of the router, on loopback with certificates made here (rcgen): reference
//! engines behind a TLS terminator (an engine's sidecar, in this process) trusted through a
//! private CA, with the client certificate an engine demands; each kind of TLS failure named
//! on `/admin/endpoints` and in the log; and the router's own HTTPS listener, HTTP/2 and
//! HTTP/1.1 by ALPN, used by the official OpenAI Python client.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess, venv_tool};
use tokio::net::{TcpListener, TcpStream};

use crate::http::client;
use crate::router::{assert_completion_matches, eventually};

/// A CA and what it signed, as PEM files in a temporary directory:
/// - `ca.pem`: the CA of the engines' and the router's certificates and of the router's
///   client certificate;
/// - `other-ca.pem`: a CA nobody here uses;
/// - `server.crt`/`server.key`: for `localhost` and `127.0.0.1`, signed by `ca.pem`;
/// - `client.crt`/`client.key`: the router's client certificate, signed by `ca.pem`;
/// - `stranger.crt`/`stranger.key`: a client certificate signed by `other-ca.pem`.
struct Pki(tempfile::TempDir);

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().expect("temp dir");
        let write = |name: &str, pem: String| {
            std::fs::write(dir.path().join(name), pem).expect("write a PEM file");
        };
        let ca = authority("switchyard test CA");
        let other = authority("another CA");
        write("ca.pem", ca.pem());
        write("other-ca.pem", other.pem());
        for (name, issuer, names, usage) in [
            (
                "server",
                &ca,
                &["localhost", "127.0.0.1"][..],
                ExtendedKeyUsagePurpose::ServerAuth,
            ),
            (
                "client",
                &ca,
                &["router"],
                ExtendedKeyUsagePurpose::ClientAuth,
            ),
            (
                "stranger",
                &other,
                &["router"],
                ExtendedKeyUsagePurpose::ClientAuth,
            ),
        ] {
            let (cert, key) = leaf(issuer, names, usage);
            write(&format!("{name}.crt"), cert);
            write(&format!("{name}.key"), key);
        }
        Pki(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }

    fn arg(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }
}

fn authority(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("CA")
}

/// A certificate for `names` signed by `issuer`, and its key, in PEM.
fn leaf(
    issuer: &CertifiedIssuer<'static, KeyPair>,
    names: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let mut params = CertificateParams::new(names).expect("leaf params");
    params.extended_key_usages = vec![usage];
    let key = KeyPair::generate().expect("key");
    let cert = params.signed_by(&key, issuer).expect("signed");
    (cert.pem(), key.serialize_pem())
}

fn certificates(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path)
        .expect("read PEM")
        .map(|cert| cert.expect("a PEM certificate"))
        .collect()
}

fn roots(ca: &Path) -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates(ca) {
        roots.add(cert).expect("a CA certificate");
    }
    roots
}

fn ring() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A TLS terminator in front of the plain `engine`, as a sidecar on the engine's pod would
/// be: `server.crt`, and when `client_ca` is given, a client certificate it signed required.
/// Its port; it serves until the test's runtime ends.
async fn https_engine(pki: &Pki, engine: SocketAddr, client_ca: Option<&Path>) -> u16 {
    let builder = rustls::ServerConfig::builder_with_provider(ring())
        .with_safe_default_protocol_versions()
        .expect("TLS versions");
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => builder.with_client_cert_verifier(
            rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots(ca)),
                ring(),
            )
            .build()
            .expect("client verifier"),
        ),
    };
    let key = PrivateKeyDer::from_pem_file(pki.path("server.key")).expect("server key");
    let config = builder
        .with_single_cert(certificates(&pki.path("server.crt")), key)
        .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let mut tls = match acceptor.accept(stream).into_fallible().await {
                    Ok(tls) => tls,
                    // Refused (the alert is sent): read what the client still sends until it
                    // hangs up, so that closing does not reset the connection before the
                    // client has read the alert.
                    Err((_, mut tcp)) => {
                        let mut sink = tokio::io::sink();
                        let drain = tokio::io::copy(&mut tcp, &mut sink);
                        let _ = tokio::time::timeout(Duration::from_secs(10), drain).await;
                        return;
                    }
                };
                let Ok(mut plain) = TcpStream::connect(engine).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    port
}

/// `switchyard serve` with `endpoints` and `args`, its log in `log`, as soon as it listens
/// (started off the runtime: the engines' terminators run on it).
async fn router(endpoints: Vec<String>, args: Vec<String>, log: PathBuf) -> RouterProcess {
    tokio::task::spawn_blocking(move || {
        let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        RouterProcess::serve_listening_logging_to(&endpoints, &args, &log)
    })
    .await
    .expect("router started")
}

/// `/admin/endpoints`, once every endpoint looks as `expected` says (each endpoint's
/// `(healthy, probe error kind)`), within 30 s.
async fn endpoints_become(url: &str, expected: &[(bool, Option<&str>)]) -> Vec<Value> {
    let admin = format!("{url}/admin/endpoints");
    let seen = |endpoints: &[Value]| -> Vec<(bool, Option<String>)> {
        endpoints
            .iter()
            .map(|e| {
                let kind = e["probe_error"]["kind"].as_str().map(str::to_owned);
                (e["healthy"] == true, kind)
            })
            .collect()
    };
    let expected: Vec<(bool, Option<String>)> = expected
        .iter()
        .map(|(healthy, kind)| (*healthy, kind.map(str::to_owned)))
        .collect();
    eventually(Duration::from_secs(30), || async {
        let endpoints = admin_endpoints(&admin).await;
        let now = seen(&endpoints);
        (now != expected).then(|| format!("{now:?}, not {expected:?}"))
    })
    .await;
    admin_endpoints(&admin).await
}

async fn admin_endpoints(admin: &str) -> Vec<Value> {
    let answer: Value = match client().get(admin).send().await {
        Ok(response) => response.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    };
    answer["endpoints"].as_array().cloned().unwrap_or_default()
}

/// An `https://` engine trusted through `--engine-ca-file` that demands a client certificate
/// gets the router's (`--engine-client-cert`/`--engine-client-key`) and serves every call and
/// probe over TLS: the router's answers are the engine's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_engines_with_a_private_ca_and_a_client_certificate_serve() {
    let pki = Pki::new();
    let engine = EngineProcess::spawn(&[]);
    let port = https_engine(&pki, engine.http_addr, Some(&pki.path("ca.pem"))).await;
    let args = [
        "--policy",
        "round-robin",
        "--engine-ca-file",
        &pki.arg("ca.pem"),
        "--engine-client-cert",
        &pki.arg("client.crt"),
        "--engine-client-key",
        &pki.arg("client.key"),
    ]
    .map(str::to_owned);
    let log = pki.path("router.log");
    let router = router(
        vec![format!("https://127.0.0.1:{port}")],
        args.to_vec(),
        log,
    )
    .await;
    endpoints_become(&router.url, &[(true, None)]).await;
    let body = json!({"prompt": "Disaggregated serving over TLS", "max_tokens": 12});
    assert_completion_matches(&router.endpoint("/v1/completions"), &engine, &body).await;
}

/// Each kind of TLS failure is named on `/admin/endpoints` (the probe's error) and in the
/// log, per endpoint, while the endpoint whose TLS is right serves: an engine certificate
/// from a CA the endpoint does not trust (its own `ca_file` wins over `engine_ca_file`), an
/// engine demanding a client certificate the router lacks, and one refusing the certificate
/// the router presents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tls_failure_is_named_per_endpoint() {
    let pki = Pki::new();
    let engine = EngineProcess::spawn(&[]);
    let ca = pki.path("ca.pem");
    let plain_tls = https_engine(&pki, engine.http_addr, None).await;
    let mtls = https_engine(&pki, engine.http_addr, Some(&ca)).await;
    let other_mtls = https_engine(&pki, engine.http_addr, Some(&ca)).await;
    let config = format!(
        r#"
policy = "round-robin"
engine_ca_file = "{ca}"

[[endpoints]]
url = "https://127.0.0.1:{plain_tls}"
ca_file = "{other_ca}"

[[endpoints]]
url = "https://127.0.0.1:{mtls}"

[[endpoints]]
url = "https://127.0.0.1:{other_mtls}"
client_cert = "{stranger_crt}"
client_key = "{stranger_key}"

[[endpoints]]
url = "https://localhost:{mtls}"
client_cert = "{client_crt}"
client_key = "{client_key}"
"#,
        ca = pki.arg("ca.pem"),
        other_ca = pki.arg("other-ca.pem"),
        stranger_crt = pki.arg("stranger.crt"),
        stranger_key = pki.arg("stranger.key"),
        client_crt = pki.arg("client.crt"),
        client_key = pki.arg("client.key"),
    );
    let config_path = pki.path("router.toml");
    std::fs::write(&config_path, config).expect("write the config");
    let log = pki.path("router.log");
    let args = vec!["--config".to_owned(), config_path.display().to_string()];
    let router = router(Vec::new(), args, log.clone()).await;
    let endpoints = endpoints_become(
        &router.url,
        &[
            (false, Some("tls_certificate_not_trusted")),
            (false, Some("tls_client_certificate_required")),
            (false, Some("tls_client_certificate_refused")),
            (true, None),
        ],
    )
    .await;
    let message = |id: usize| {
        endpoints[id]["probe_error"]["message"]
            .as_str()
            .map(str::to_owned)
    };
    let logged = std::fs::read_to_string(&log).expect("the router's log");
    for id in 0..3 {
        let message = message(id).expect("a probe error message");
        assert!(
            logged.contains(&message),
            "endpoint {id}'s {message:?} is not in the log:\n{logged}"
        );
    }
    let body = json!({"prompt": "only the right TLS serves", "max_tokens": 8});
    assert_completion_matches(&router.endpoint("/v1/completions"), &engine, &body).await;
}

/// The router's listener with `--tls-cert`/`--tls-key`: HTTP/2 or HTTP/1.1 as the client's
/// ALPN asks, plain HTTP refused, and the official OpenAI Python client (its own HTTP stack,
/// trusting the test CA) gets completions and a chat stream over HTTPS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_https_listener_speaks_h2_and_http1_to_any_client() {
    let pki = Pki::new();
    let engine = EngineProcess::spawn(&[]);
    let args = [
        "--policy",
        "round-robin",
        "--tls-cert",
        &pki.arg("server.crt"),
        "--tls-key",
        &pki.arg("server.key"),
    ]
    .map(str::to_owned);
    let router = router(
        vec![engine.url.clone()],
        args.to_vec(),
        pki.path("router.log"),
    )
    .await;
    assert!(router.url.starts_with("https://"), "{}", router.url);
    let ca = pki.path("ca.pem");
    eventually(Duration::from_secs(30), || async {
        let (_, status, body) = tls_get(router.addr, &ca, b"http/1.1", "/health").await;
        (status != 200).then(|| format!("/health {status}: {body}"))
    })
    .await;
    for alpn in [&b"h2"[..], b"http/1.1"] {
        let (negotiated, status, body) = tls_get(router.addr, &ca, alpn, "/v1/models").await;
        assert_eq!(negotiated, alpn, "ALPN");
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("switchyard-reference"), "{body}");
    }
    let plain = client()
        .get(format!("http://{}/health", router.addr))
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP answered: {plain:?}");

    let python = venv_tool("python");
    let base_url = router.endpoint("/v1");
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .args(["-c", OPENAI_OVER_HTTPS, &base_url])
            .arg(&ca)
            .output()
            .expect("run the OpenAI client")
    })
    .await
    .expect("joined");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.starts_with("ok"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The official OpenAI client, its HTTP client trusting only the test CA: a
/// completion, and a streamed chat whose text is not empty.
const OPENAI_OVER_HTTPS: &str = r#"
import ssl, sys
import openai
base_url, ca = sys.argv[1], sys.argv[2]
tls = ssl.create_default_context(cafile=ca)
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0,
                       http_client=openai.DefaultHttpxClient(verify=tls))
r = client.completions.create(model="switchyard-reference", prompt="over https", max_tokens=8)
assert r.choices[0].text and r.usage.completion_tokens == len(r.choices[0].text), r
chunks = list(client.chat.completions.create(
    model="switchyard-reference", messages=[{"role": "user", "content": "hi"}],
    max_tokens=8, stream=True))
assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks
print("ok")
"#;

/// `GET path` over TLS to `addr` (trusting `ca`) on a connection offering only `alpn`: the
/// protocol the server chose, the status and the body.
async fn tls_get(addr: SocketAddr, ca: &Path, alpn: &[u8], path: &str) -> (Vec<u8>, u16, String) {
    let mut config = rustls::ClientConfig::builder_with_provider(ring())
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots(ca))
        .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::try_from("127.0.0.1").expect("a server name");
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .expect("TLS handshake");
    let negotiated = tls.get_ref().1.alpn_protocol().unwrap_or_default().to_vec();
    let io = TokioIo::new(tls);
    let request = hyper::Request::get(format!("https://{addr}{path}"))
        .body(Empty::<Bytes>::new())
        .expect("request");
    let response = if negotiated == b"h2" {
        let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .expect("h2 handshake");
        tokio::spawn(conn);
        sender.send_request(request).await.expect("h2 response")
    } else {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .expect("http1 handshake");
        tokio::spawn(conn);
        sender.send_request(request).await.expect("http1 response")
    };
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (
        negotiated,
        status,
        String::from_utf8_lossy(&body).into_owned(),
    )
}
