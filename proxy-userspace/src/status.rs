//! kube-proxy's debugging pages on the metrics server ("z-pages"): `/statusz` (when the
//! process started, its version), `/flagz` (the flags it was started with) and `/configz` (the
//! effective configuration, as a KubeProxyConfiguration under its group name). Like kube-proxy's,
//! the text pages are for people, not for parsing.
use std::{collections::BTreeMap, sync::Arc, time::SystemTime};

use crate::{
    health::process_start,
    http::{Handler, Reply},
    metrics::{Registry, TEXT_FORMAT},
    settings::Settings,
};

/// The metrics server's routes: `/metrics`, `/proxyMode` (the running dataplane's mode, as
/// kube-proxy answers it), `/healthz` (a plain liveness ping, as kube-proxy's metrics server
/// has one) and the status `pages`.
pub fn metrics_server(registry: Arc<Registry>, pages: StatusPages, proxy_mode: &'static str) -> Handler {
    Arc::new(move |path| {
        pages.reply(path).unwrap_or_else(|| match path {
            "/metrics" => Reply::new(200, TEXT_FORMAT, registry.encode()),
            "/proxyMode" => Reply::new(200, Reply::TEXT, proxy_mode),
            "/healthz" => Reply::new(200, Reply::TEXT, "ok"),
            _ => Reply::not_found(),
        })
    })
}

/// The warning kube-proxy's text z-pages start with.
const NOT_FOR_MACHINES: &str =
    "Warning: This endpoint is not meant to be machine parseable, has no formatting \
     compatibility guarantees and is for debugging purposes only.";

/// The pages, computed once at start (vipr's flags and configuration do not change while it
/// runs).
#[derive(Clone, Debug)]
pub struct StatusPages {
    started: SystemTime,
    flags: BTreeMap<String, String>,
    configz: String,
}

impl StatusPages {
    /// `argv`: the command line, program name first.
    pub fn new(settings: &Settings, argv: impl IntoIterator<Item = String>) -> Self {
        let configz =
            serde_json::json!({ "kubeproxy.config.k8s.io": settings.to_kube_proxy_configuration() });
        Self {
            started: SystemTime::now() - process_start().elapsed(),
            flags: flags_given(argv.into_iter().skip(1)),
            configz: configz.to_string(),
        }
    }

    /// The answer for `path`, if it is one of the pages.
    pub fn reply(&self, path: &str) -> Option<Reply> {
        match path {
            "/statusz" => Some(Reply::new(200, Reply::TEXT, self.statusz())),
            "/flagz" => {
                let flags: String =
                    self.flags.iter().map(|(name, value)| format!("{name}={value}\n")).collect();
                Some(Reply::new(200, Reply::TEXT, format!("vipr flags\n{NOT_FOR_MACHINES}\n\n{flags}")))
            }
            "/configz" => Some(Reply::new(200, Reply::JSON, self.configz.clone())),
            _ => None,
        }
    }

    fn statusz(&self) -> String {
        let started = jiff::Timestamp::try_from(self.started)
            .map(|time| time.strftime("%a %b %e %H:%M:%S UTC %Y").to_string())
            .unwrap_or_default();
        let up = process_start().elapsed().as_secs();
        format!(
            "vipr statusz\n{NOT_FOR_MACHINES}\n\nStarted: {started}\nUp: {} hr {:02} min {:02} sec\n\
             Binary version: vipr {}\n",
            up / 3600,
            up % 3600 / 60,
            up % 60,
            env!("CARGO_PKG_VERSION"),
        )
    }
}

/// The flags of a command line, by name without dashes: `--name=value`, `--name value`, or
/// `--name` alone (`true`); the last of a repeated flag wins, as it does when they are parsed.
fn flags_given(args: impl IntoIterator<Item = String>) -> BTreeMap<String, String> {
    let mut flags = BTreeMap::new();
    let mut args = args.into_iter().peekable();
    while let Some(arg) = args.next() {
        let Some(flag) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) else { continue };
        let (name, value) = match flag.split_once('=') {
            Some((name, value)) => (name.to_owned(), value.to_owned()),
            None => {
                let value = args.next_if(|next| !next.starts_with('-')).unwrap_or_else(|| "true".to_owned());
                (flag.to_owned(), value)
            }
        };
        flags.insert(name, value);
    }
    flags
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Args;

    #[test]
    fn the_metrics_server_answers_metrics_the_mode_and_the_pages() {
        let registry = Arc::new(Registry::default());
        registry.register(Arc::new(crate::metrics::ProxyMetrics::default()));
        let handler = metrics_server(registry, pages(&["--proxy-mode=ebpf"]), "ebpf");
        let metrics = handler("/metrics");
        assert_eq!((metrics.status, metrics.content_type), (200, TEXT_FORMAT));
        assert!(metrics.body.contains("# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram"));
        assert_eq!(handler("/proxyMode").body, "ebpf");
        assert_eq!(handler("/healthz").body, "ok");
        assert_eq!(handler("/statusz").status, 200);
        assert_eq!(handler("/nope").status, 404);
    }

    fn pages(argv: &[&str]) -> StatusPages {
        let argv: Vec<String> =
            std::iter::once("vipr").chain(argv.iter().copied()).map(str::to_owned).collect();
        let args = Args::try_parse_kube_proxy_style(argv.clone()).unwrap();
        StatusPages::new(&Settings::resolve(&args).unwrap(), argv)
    }

    #[test]
    fn flagz_lists_the_flags_given() {
        let pages = pages(&["--proxy-mode=iptables", "--v", "2", "--masquerade-all", "--proxy-mode=ebpf"]);
        let flagz = pages.reply("/flagz").unwrap().body;
        assert!(flagz.starts_with("vipr flags\nWarning: "), "{flagz}");
        assert!(flagz.ends_with("\n\nmasquerade-all=true\nproxy-mode=ebpf\nv=2\n"), "{flagz}");
    }

    #[test]
    fn configz_is_the_effective_kube_proxy_configuration() {
        let reply = pages(&["--proxy-mode=ipvs", "--ipvs-sync-period=45s"]).reply("/configz").unwrap();
        assert_eq!(reply.content_type, Reply::JSON);
        let config: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        let config = &config["kubeproxy.config.k8s.io"];
        assert_eq!(config["mode"], "ipvs");
        assert_eq!(config["ipvs"]["syncPeriod"], "45s");
        assert_eq!(config["healthzBindAddress"], "0.0.0.0:10256");
    }

    #[test]
    fn statusz_says_when_vipr_started_and_its_version() {
        let statusz = pages(&[]).reply("/statusz").unwrap().body;
        assert!(statusz.starts_with("vipr statusz\nWarning: "), "{statusz}");
        assert!(statusz.contains("\nStarted: ") && statusz.contains("\nUp: 0 hr"), "{statusz}");
        assert!(statusz.contains(concat!("Binary version: vipr ", env!("CARGO_PKG_VERSION"))), "{statusz}");
        assert!(pages(&[]).reply("/metrics").is_none());
    }
}
