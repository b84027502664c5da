//! agent.*: the service judging itself — can the platform hear it, and is its endpoint locked.
//! Pure functions of the service's own state, added to every report `serve` publishes.

use crate::checks::Finding;
use crate::config::Config;
use crate::snapshot::Timestamp;

/// What the push loop last saw, shared with the snapshot task.
#[derive(Debug, Clone, Default)]
pub struct PushState {
    pub last_accepted: Option<Timestamp>,
    /// The last failure and when failures began; cleared by a success.
    pub failing: Option<(Timestamp, String)>,
    pub last_refusal: Option<String>,
    pub spooled: usize,
}

pub fn platform_reachable(config: &Config, push: &PushState) -> Finding {
    const ID: &str = "agent.platform-reachable";
    if config.platform.url.is_empty() {
        return Finding::pass(ID, "no platform configured (platform.url is empty): nothing is pushed");
    }
    let f = match (&push.failing, &push.last_refusal, &push.last_accepted) {
        (Some((since, why)), _, _) => Finding::warn(ID, format!("the platform has not accepted a report since {since}"))
            .detail(format!("Last failure: {why}. {} event(s) wait in the spool and will be sent, in order, once it answers.", push.spooled))
            .remedy("Check that the platform URL is reachable from the VM (DNS, egress policy), its CA (platform.ca_file) and the token in platform.token_file."),
        (None, Some(why), _) => Finding::fail(ID, "the platform refused a report")
            .detail(format!("{why}. Refused events are kept in state_dir/spool/refused."))
            .remedy("Compare platform.token_file with what the platform expects for this agent id; the refused reports can be re-sent by moving them back into the spool."),
        (None, None, Some(at)) => Finding::pass(ID, format!("last report accepted at {at}")),
        (None, None, None) => Finding::pass(ID, "no report sent yet"),
    };
    f.evidence("url", &config.platform.url).evidence("spooled", push.spooled)
}

/// How `/v1/status` and `/metrics` are locked, on each channel the config opens: TCP (`[http]`)
/// and the platform's vsock (`[vsock]`). The bearer token guards TCP unless client certificates
/// do, and plain vsock always; vsock with TLS is guarded by its client certificate alone.
pub fn endpoint_auth(config: &Config, token_loaded: bool) -> Finding {
    const ID: &str = "agent.endpoint-auth";
    let (h, v) = (&config.http, &config.vsock);
    let tls = !h.tls_cert.is_empty();
    let mtls = tls && !h.client_ca.is_empty();
    let vsock = match (v.enabled, v.tls) {
        (false, _) => "No vsock listener (vsock.enabled = false).".to_string(),
        (true, true) => format!(
            "vsock port {}: a client certificate chained to {} (KubeVirt's CA) is required, over TLS 1.3.",
            v.port,
            v.client_ca.display()
        ),
        (true, false) => format!("vsock port {}: plain (vsock.tls = false), the bearer token is required.", v.port),
    };
    let token_guards: Vec<&str> = [(h.enabled && !mtls, "TCP"), (v.enabled && !v.tls, "plain vsock")]
        .iter()
        .filter(|c| c.0)
        .map(|c| c.1)
        .collect();
    let f = if !token_loaded && !token_guards.is_empty() {
        Finding::fail(ID, format!("no bearer token: /v1/status and /metrics answer 503 to everyone over {} ({} is missing)", token_guards.join(" and "), h.token_file.display()))
            .detail(vsock)
            .remedy(format!("Create it: `install -m 600 /dev/null {p} && head -c 32 /dev/urandom | base64 > {p}`, give the same token to the platform's poller and Prometheus, then `systemctl reload phq-agent`.", p = h.token_file.display()))
    } else if !h.enabled {
        Finding::pass(ID, "no TCP listener (http.enabled = false): only the platform's vsock channel and D-Bus answer")
            .detail(vsock)
    } else if !tls && !h.listen.ip().is_loopback() {
        Finding::pass(ID, "bearer token required; served over plain HTTP").detail(format!(
            "The token crosses the cluster network in clear text; set http.tls_cert and http.tls_key to serve HTTPS. {vsock}"
        ))
    } else {
        Finding::pass(
            ID,
            if mtls {
                "client certificates or the bearer token required, over HTTPS"
            } else if tls {
                "bearer token required, over HTTPS"
            } else {
                "bearer token required; loopback only"
            },
        )
        .detail(vsock)
    };
    f.evidence("listen", if h.enabled { h.listen.to_string() } else { "off".into() })
        .evidence("tls", tls)
        .evidence("client_ca", mtls)
        .evidence(
            "vsock",
            if v.enabled {
                if v.tls {
                    "tls"
                } else {
                    "plain"
                }
            } else {
                "off"
            },
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::Severity;

    #[test]
    fn platform_states() {
        let mut c = Config::default();
        assert_eq!(platform_reachable(&c, &PushState::default()).severity, Severity::Pass);
        c.platform.url = "https://platform.example".into();
        let failing = PushState {
            failing: Some((Timestamp::from_unix_millis(0), "connection refused".into())),
            spooled: 3,
            ..Default::default()
        };
        let f = platform_reachable(&c, &failing);
        assert_eq!(f.severity, Severity::Warn);
        assert!(f.detail.contains("3 event(s) wait in the spool"));
        let refused = PushState { last_refusal: Some("401".into()), ..Default::default() };
        assert_eq!(platform_reachable(&c, &refused).severity, Severity::Fail);
    }

    #[test]
    fn endpoint_states() {
        let mut c = Config::default();
        assert_eq!(endpoint_auth(&c, false).severity, Severity::Fail);
        let f = endpoint_auth(&c, true);
        assert_eq!(f.severity, Severity::Pass);
        assert!(f.detail.contains("clear text"));
        c.http.tls_cert = "/c.pem".into();
        c.http.tls_key = "/k.pem".into();
        c.http.client_ca = "/ca.pem".into();
        let f = endpoint_auth(&c, false);
        assert_eq!(f.severity, Severity::Pass, "{f:?}");
        assert!(f.detail.contains("vsock port 9440: a client certificate chained to"), "{}", f.detail);

        // Plain vsock wants the token even where TCP has client certificates.
        c.vsock.tls = false;
        let f = endpoint_auth(&c, false);
        assert_eq!(f.severity, Severity::Fail);
        assert!(f.summary.contains("over plain vsock ("), "{}", f.summary);

        // TCP off and vsock over TLS: the client certificate is the lock, no token needed.
        let mut c = Config::default();
        c.http.enabled = false;
        let f = endpoint_auth(&c, false);
        assert_eq!(f.severity, Severity::Pass, "{f:?}");
        assert!(f.summary.starts_with("no TCP listener"), "{}", f.summary);
        c.vsock.tls = false;
        assert_eq!(endpoint_auth(&c, false).severity, Severity::Fail, "plain vsock with no token");
        c.vsock.enabled = false;
        assert_eq!(endpoint_auth(&c, false).severity, Severity::Pass, "nothing listens but D-Bus");
    }
}
