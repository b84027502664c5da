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

pub fn endpoint_auth(config: &Config, token_loaded: bool) -> Finding {
    const ID: &str = "agent.endpoint-auth";
    let tls = !config.http.tls_cert.is_empty();
    let mtls = tls && !config.http.client_ca.is_empty();
    let f = if !token_loaded && !mtls {
        Finding::fail(ID, format!("no bearer token: /v1/status and /metrics answer 503 to everyone ({} is missing)", config.http.token_file.display()))
            .remedy(format!("Create it: `install -m 600 /dev/null {p} && head -c 32 /dev/urandom | base64 > {p}`, give the same token to the platform's poller and Prometheus, then `systemctl reload phq-agent`.", p = config.http.token_file.display()))
    } else if !tls && !config.http.listen.ip().is_loopback() {
        Finding::pass(ID, "bearer token required; served over plain HTTP").detail(
            "The token crosses the cluster network in clear text; set http.tls_cert and http.tls_key to serve HTTPS.",
        )
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
    };
    f.evidence("listen", config.http.listen.to_string()).evidence("tls", tls).evidence("client_ca", mtls)
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
        assert_eq!(endpoint_auth(&c, false).severity, Severity::Pass);
    }
}
