//! The standard process metrics (`process_*`, as Prometheus's client libraries export them and
//! kube-proxy's `/metrics` has them: dashboards chart the proxy's CPU and memory with them), and
//! `vipr_build_info`. Read from /proc when scraped.
use super::{Collector, MetricFamily, MetricKind, Sample, SampleValue};

/// `process_*` of this process, and `vipr_build_info`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessMetrics;

impl Collector for ProcessMetrics {
    fn collect(&self) -> Vec<MetricFamily> {
        let mut families = vec![MetricFamily {
            name: "vipr_build_info".to_owned(),
            help: "vipr's version; always 1".to_owned(),
            kind: MetricKind::Gauge,
            samples: vec![Sample {
                labels: vec![("version".to_owned(), env!("CARGO_PKG_VERSION").to_owned())],
                value: SampleValue::Number(1.0),
            }],
        }];
        let Some(stat) = std::fs::read_to_string("/proc/self/stat").ok().and_then(|text| Stat::parse(&text))
        else {
            return families;
        };
        // SAFETY: sysconf only reads system constants.
        let (ticks, page_size) =
            unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
        let ticks = if ticks > 0 { ticks as f64 } else { 100.0 };
        let boot_time = std::fs::read_to_string("/proc/stat").ok().and_then(|text| {
            text.lines().find_map(|line| line.strip_prefix("btime ")?.trim().parse::<f64>().ok())
        });
        let gauge =
            |name: &str, help: &str, value: f64| MetricFamily::single(name, help, MetricKind::Gauge, value);
        families.push(MetricFamily::single(
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            MetricKind::Counter,
            (stat.utime + stat.stime) as f64 / ticks,
        ));
        families.push(gauge(
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            stat.rss_pages as f64 * page_size.max(1) as f64,
        ));
        families.push(gauge(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            stat.vsize as f64,
        ));
        if let Some(boot_time) = boot_time {
            families.push(gauge(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                boot_time + stat.start_ticks as f64 / ticks,
            ));
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            families.push(gauge("process_open_fds", "Number of open file descriptors.", fds.count() as f64));
        }
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes the struct it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
            families.push(gauge(
                "process_max_fds",
                "Maximum number of open file descriptors.",
                limit.rlim_cur as f64,
            ));
        }
        families
    }
}

/// The fields of /proc/self/stat the metrics need.
#[derive(Debug, PartialEq, Eq)]
struct Stat {
    utime: u64,
    stime: u64,
    start_ticks: u64,
    vsize: u64,
    rss_pages: u64,
}

impl Stat {
    /// Fields are counted after the command name, which is in parentheses and may hold spaces.
    fn parse(text: &str) -> Option<Self> {
        let after_name = &text[text.rfind(')')? + 1..];
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        // `fields[0]` is field 3 (state) of proc(5).
        let field = |number: usize| fields.get(number - 3)?.parse::<u64>().ok();
        Some(Self {
            utime: field(14)?,
            stime: field(15)?,
            start_ticks: field(22)?,
            vsize: field(23)?,
            rss_pages: field(24)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        let line =
            "1234 (vipr (a) b) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0 4242 123456789 2048 \
                    18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0";
        assert_eq!(
            Stat::parse(line),
            Some(Stat { utime: 250, stime: 50, start_ticks: 4242, vsize: 123_456_789, rss_pages: 2048 })
        );
        assert_eq!(Stat::parse("garbage"), None);
    }

    #[test]
    fn the_process_families_are_reported() {
        let families = ProcessMetrics.collect();
        let names: Vec<&str> = families.iter().map(|family| family.name.as_str()).collect();
        for name in [
            "vipr_build_info",
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_virtual_memory_bytes",
            "process_start_time_seconds",
            "process_open_fds",
            "process_max_fds",
        ] {
            assert!(names.contains(&name), "no {name} in {names:?}");
        }
        let value =
            |name: &str| match families.iter().find(|family| family.name == name).unwrap().samples[0].value {
                SampleValue::Number(value) => value,
                SampleValue::Histogram { .. } => unreachable!(),
            };
        assert!(value("process_resident_memory_bytes") > 0.0);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        let started = value("process_start_time_seconds");
        assert!(started <= now + 1.0 && started > now - 86_400.0 * 365.0, "{started}");
    }
}
