//! HTTPS and client certificates on the real service: certificates made for the test (rcgen),
//! a reqwest client on 127.0.0.1.

mod common;

use common::*;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

struct Pki {
    ca: String,
    server: (String, String),
    /// The platform's poller: named `phq-platform` (http.client_names' default), clientAuth.
    client: (String, String),
    stranger: (String, String),
    /// From the platform's CA, but another name: not the platform.
    other_name: (String, String),
}

fn pki() -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf = |names: Vec<String>, issuer: &CertifiedIssuer<'_, KeyPair>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names).unwrap().signed_by(&key, issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let client_named = |cn: &str, issuer: &CertifiedIssuer<'_, KeyPair>| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = p.signed_by(&key, issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let mut other_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    other_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let other_ca = CertifiedIssuer::self_signed(other_params, KeyPair::generate().unwrap()).unwrap();
    Pki {
        ca: ca.pem(),
        server: leaf(vec!["localhost".into(), "127.0.0.1".into()], &ca),
        client: client_named("phq-platform", &ca),
        stranger: client_named("phq-platform", &other_ca),
        other_name: client_named("someone-else", &ca),
    }
}

#[test]
fn https_with_client_certificates_or_the_token() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let w = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let token = w("token", "tok-0123456789abcdef-tls\n");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (cert, key, ca) = (w("server.pem", &pki.server.0), w("server.key", &pki.server.1), w("ca.pem", &pki.ca));
    let cfg = w(
        "config.toml",
        &format!(
            "[agent]\nstate_dir = \"{}\"\n[http]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\ntls_cert = \"{}\"\ntls_key = \"{}\"\nclient_ca = \"{}\"\n",
            dir.path().join("state").display(),
            token.display(),
            cert.display(),
            key.display(),
            ca.display()
        ),
    );
    let Some(bus) = PrivateBus::start(HEALTHY_UNITS) else { return };
    let mut agent =
        serve_command(&cfg, &repo().join("examples/scenarios/hgx-8gpu-healthy.json"), &bus).spawn().unwrap();
    let port = listening_port(&mut agent).expect("the agent listens");

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = |identity: Option<&(String, String)>| {
        let mut b = reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(pki.ca.as_bytes()).unwrap())
            .timeout(Duration::from_secs(5));
        if let Some((c, k)) = identity {
            b = b.identity(reqwest::Identity::from_pem(format!("{c}{k}").as_bytes()).unwrap());
        }
        b.build().unwrap()
    };
    let url = |path: &str| format!("https://localhost:{port}{path}");
    rt.block_on(async {
        let anonymous = client(None);
        let deadline = Instant::now() + Duration::from_secs(20);
        // readinessProbe-like: no certificate, no token
        // (503 "starting" until the first snapshot is published)
        let health = loop {
            match anonymous.get(url("/healthz")).send().await {
                Ok(r) if r.status() != 503 => break r,
                other => {
                    assert!(Instant::now() < deadline, "HTTPS never became ready: {other:?}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        assert_eq!(health.status(), 200);
        // no certificate: the token is needed
        assert_eq!(anonymous.get(url("/v1/status")).send().await.unwrap().status(), 401);
        let with_token = anonymous.get(url("/v1/status")).bearer_auth("tok-0123456789abcdef-tls").send().await.unwrap();
        assert_eq!(with_token.status(), 200);
        // a certificate the client CA signed: no token needed
        let poller = client(Some(&pki.client));
        let r = poller.get(url("/metrics")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.text().await.unwrap().contains("phq_gpu_temperature_celsius"));
        // a certificate from another CA: the handshake fails
        let stranger = client(Some(&pki.stranger));
        assert!(stranger.get(url("/v1/status")).send().await.is_err(), "a stranger's certificate must not get through");
        // the platform's CA, another name: refused too (issue 50: http.client_names)
        let other = client(Some(&pki.other_name));
        assert!(
            other.get(url("/v1/status")).send().await.is_err(),
            "a certificate with another name must not get through"
        );
        // The platform's certificate may start work, and the run names it (issue 50); the read
        // token may not.
        let read = anonymous.post(url("/v1/probes")).bearer_auth("tok-0123456789abcdef-tls").send().await.unwrap();
        assert_eq!(read.status(), 403);
        let started = loop {
            let r = poller.post(url("/v1/probes")).send().await.unwrap();
            // The boot run goes first: 409 until it ends.
            if r.status() != 409 {
                break r;
            }
            assert!(Instant::now() < deadline + Duration::from_secs(100), "the boot run never ended");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(started.status(), 202);
        let run: serde_json::Value = serde_json::from_str(&started.text().await.unwrap()).unwrap();
        assert_eq!(
            run["asked_by"],
            serde_json::json!({"who": "platform", "over": "tcp", "name": "phq-platform"}),
            "{run:#}"
        );
        // plain HTTP on the HTTPS port gets nothing
        let plain = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().unwrap();
        assert!(plain
            .get(format!("http://127.0.0.1:{port}/healthz"))
            .send()
            .await
            .map(|r| r.status() != 200)
            .unwrap_or(true));
    });
    let _ = agent.kill();
    let _ = agent.wait();
}
