//! The maps' entries in a readable, comparable form, for `vipr inspect drift`: what the agent
//! meant the maps to hold (its encoding of the desired state, recorded to a file after every
//! sync that changed it) against what the pins hold. Both sides go through the same
//! conversion, so a difference is a difference of the maps' content, never of two encodings.
//!
//! The record is written whole to a temporary file and renamed over the previous one, so a
//! reader sees one sync's record or the next, never half of one; and it lives outside the
//! agent, so `vipr inspect` compares while the agent is stopped too. A sync that changed a few
//! entries appends only those to the record's journal ([`Recorder`]), so that recording costs
//! what the sync changed, not the whole state; the record is written whole again when the
//! journal has grown as large as it.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    io::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use aya::maps::{HashMap, LpmTrie, Map, MapData};
use proxy_common::{pins, service_flags, source_class, unmatched, Backend, BackendSlot, Service, ServiceKey};
use serde::{Deserialize, Serialize};

use super::{
    encode::{FamilyWanted, LpmKey, Wanted},
    family::{Family, V4, V6},
    mirror::KeyedMap as _,
    plan::WantedService,
};

/// The record of the datapath pinned under `bpf_root`, in the state directory
/// (`--state-dir`): one file per bpffs (`ebpf-desired-state-sys-fs-bpf.json` for
/// `/sys/fs/bpf`), so that agents on several bpffs keep theirs apart and `vipr inspect` finds
/// the one of the `--bpf-root` it is given.
pub fn path(state_dir: &Path, bpf_root: &Path) -> PathBuf {
    let root = bpf_root.canonicalize().unwrap_or_else(|_| bpf_root.to_owned());
    let escaped: String = root
        .to_string_lossy()
        .trim_matches('/')
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '_' { c } else { '-' })
        .collect();
    state_dir.join(format!("ebpf-desired-state-{escaped}.json"))
}

/// Bumped when the record's layout changes: an older record is refused, not misread.
const FORMAT: u32 = 2;

/// What the agent meant the maps under `pin_dir` to hold.
#[derive(Debug, Serialize, Deserialize)]
pub struct Record {
    pub format: u32,
    /// The pin directory the entries are for (`<bpf-root>/vipr`).
    pub pin_dir: PathBuf,
    /// The sync that wrote them, in seconds since the epoch.
    pub written_unix_seconds: u64,
    /// Names this record for its journal: lines written for another one are ignored.
    pub base: u64,
    pub entries: Entries,
}

/// One line of a record's journal: the entries one sync changed.
#[derive(Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta {
    /// The record ([`Record::base`]) this line follows.
    pub base: u64,
    /// Services-map entries written (`Some`) or deleted (`None`).
    pub services: BTreeMap<String, Option<ServiceEntry>>,
    /// The classification and filter maps, whole, when they changed.
    pub classifiers: Option<BTreeMap<String, BTreeMap<String, u8>>>,
}

impl Delta {
    /// The entries of `wanted` under the services-map keys `v4` and `v6` (a key `wanted` no
    /// longer has is a deletion), and the classifiers when `classifiers` changed.
    pub fn of(
        wanted: &Wanted,
        v4: &BTreeSet<ServiceKey<V4>>,
        v6: &BTreeSet<ServiceKey<V6>>,
        classifiers: bool,
    ) -> Self {
        let mut delta = Self::default();
        delta.add_services(&wanted.v4, v4);
        delta.add_services(&wanted.v6, v6);
        if classifiers {
            let mut entries = Entries::default();
            entries.add_classifiers(&wanted.v4);
            entries.add_classifiers(&wanted.v6);
            delta.classifiers = Some(entries.classifiers);
        }
        delta
    }

    fn add_services<F: Family>(&mut self, wanted: &FamilyWanted<F>, keys: &BTreeSet<ServiceKey<F>>) {
        for key in keys {
            let entry = wanted.services.get(key).map(|service| service_entry::<F>(key, service).1);
            self.services.insert(service_key_name::<F>(key, F::source_class(key)), entry);
        }
    }

    fn apply(self, entries: &mut Entries) {
        for (key, entry) in self.services {
            match entry {
                Some(entry) => entries.services.insert(key, entry),
                None => entries.services.remove(&key),
            };
        }
        if let Some(classifiers) = self.classifiers {
            entries.classifiers = classifiers;
        }
    }
}

/// Writes the record of one pin directory: whole, or a sync's [`Delta`] appended to its
/// journal.
#[derive(Debug)]
pub struct Recorder {
    path: PathBuf,
    pin_dir: PathBuf,
    /// The record on disk that the journal follows; `None`: the next write is whole.
    base: Option<u64>,
    record_bytes: u64,
    journal_bytes: u64,
}

/// The journal is never let grow past this, however small the record.
const JOURNAL_MIN_LIMIT: u64 = 1 << 20;

impl Recorder {
    pub fn new(path: PathBuf, pin_dir: &Path) -> Self {
        Self { path, pin_dir: pin_dir.to_owned(), base: None, record_bytes: 0, journal_bytes: 0 }
    }

    /// Whether [`Self::append`] can be used (a record this recorder wrote is there).
    pub fn has_record(&self) -> bool {
        self.base.is_some()
    }

    /// Writes `entries` as the record, whole, and starts its journal anew.
    pub fn write_whole(&mut self, entries: &Entries) -> anyhow::Result<()> {
        self.base = None;
        let base = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos() as u64);
        self.record_bytes = write(&self.path, &self.pin_dir, base, entries)?;
        let journal = journal_path(&self.path);
        std::fs::File::create(&journal).with_context(|| format!("cannot empty {}", journal.display()))?;
        self.journal_bytes = 0;
        self.base = Some(base);
        Ok(())
    }

    /// Appends `delta` to the journal; `Ok(false)` when the journal would outgrow the record
    /// (the caller then writes the record whole).
    pub fn append(&mut self, mut delta: Delta) -> anyhow::Result<bool> {
        let Some(base) = self.base else { return Ok(false) };
        delta.base = base;
        let mut line = serde_json::to_vec(&delta).context("cannot encode a record's journal line")?;
        line.push(b'\n');
        if self.journal_bytes + line.len() as u64 > self.record_bytes.max(JOURNAL_MIN_LIMIT) {
            return Ok(false);
        }
        let journal = journal_path(&self.path);
        let appended = std::fs::OpenOptions::new()
            .append(true)
            .open(&journal)
            .and_then(|mut file| file.write_all(&line));
        if let Err(error) = appended {
            // What was written of the line is ignored by readers; the next write is whole.
            self.base = None;
            return Err(error).with_context(|| format!("cannot append to {}", journal.display()));
        }
        self.journal_bytes += line.len() as u64;
        Ok(true)
    }
}

fn journal_path(record: &Path) -> PathBuf {
    let mut path = record.as_os_str().to_owned();
    path.push(".journal");
    PathBuf::from(path)
}

/// Every entry vipr writes, keyed readably: the services maps' entries with their backends in
/// slot order, and the classification and filter maps' keys and values by map.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entries {
    /// `TCP 10.96.0.10:80 from pod` → the entry.
    pub services: BTreeMap<String, ServiceEntry>,
    /// Map name → key (`10.0.0.0/8`, `service 3 from 10.0.0.0/8`, `10.1.0.1`) → value.
    pub classifiers: BTreeMap<String, BTreeMap<String, u8>>,
}

/// A services-map entry with its backend set resolved (set ids are the planner's choice and
/// say nothing by themselves; counter indices are the agent's bookkeeping).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceEntry {
    pub service_id: u32,
    pub flags: u32,
    pub affinity_timeout: u32,
    /// Slot `i` holds `backends[i]` (a backend holds several slots in a Maglev table). Read
    /// from the maps, a missing slot ends the list.
    pub backends: Vec<SocketAddr>,
}

impl fmt::Display for ServiceEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "service {}", self.service_id)?;
        let flags = flag_names(self.flags, !self.backends.is_empty());
        if !flags.is_empty() {
            write!(f, " [{}]", flags.join(","))?;
        }
        if self.affinity_timeout != 0 {
            write!(f, " affinity {}s", self.affinity_timeout)?;
        }
        let mut slots: BTreeMap<SocketAddr, usize> = BTreeMap::new();
        for backend in &self.backends {
            *slots.entry(*backend).or_default() += 1;
        }
        let backends: Vec<String> = slots
            .into_iter()
            .map(
                |(backend, count)| {
                    if count == 1 {
                        backend.to_string()
                    } else {
                        format!("{backend}×{count}")
                    }
                },
            )
            .collect();
        write!(f, " -> {}", if backends.is_empty() { "no backends".to_owned() } else { backends.join(" ") })
    }
}

/// The Kubernetes name of an IP protocol number, "?" for one no Service uses.
pub fn protocol_name(number: u8) -> &'static str {
    crate::model::Protocol::from_number(number).map_or("?", crate::model::Protocol::kubernetes_name)
}

pub fn source_name(class: u8) -> &'static str {
    match class {
        source_class::OUTSIDE => "outside",
        source_class::POD => "pod",
        source_class::NODE => "node",
        // The entry a DSR request's carried service address is checked against.
        source_class::CARRIED => "carried",
        _ => "?",
    }
}

/// The names of a services entry's flags, and what it does without backends.
pub fn flag_names(flags: u32, has_backends: bool) -> Vec<&'static str> {
    let mut names = Vec::new();
    for (bit, name) in [
        (service_flags::MASQUERADE, "masquerade"),
        (service_flags::REJECT_WHEN_EMPTY, "reject-when-empty"),
        (service_flags::SOURCE_RANGES, "source-ranges"),
        (service_flags::MAGLEV, "maglev"),
    ] {
        if flags & bit != 0 {
            names.push(name);
        }
    }
    if !has_backends {
        names.push(if flags & service_flags::REJECT_WHEN_EMPTY != 0 { "rejects" } else { "drops" });
    }
    names
}

fn service_key_name<F: Family>(key: &ServiceKey<F>, class: u8) -> String {
    let (ip, port, protocol) = F::frontend(key);
    format!("{} {} from {}", protocol_name(protocol), SocketAddr::new(ip, port), source_name(class))
}

/// A services-map entry as the record keys and holds it.
fn service_entry<F: Family>(key: &ServiceKey<F>, service: &WantedService<F>) -> (String, ServiceEntry) {
    let backends = service
        .backends
        .iter()
        .map(|backend| {
            let (ip, port, _counter) = F::backend_parts(backend);
            SocketAddr::new(ip, port)
        })
        .collect();
    let entry = ServiceEntry {
        service_id: service.service_id,
        flags: service.flags,
        affinity_timeout: service.affinity_timeout,
        backends,
    };
    (service_key_name::<F>(key, F::source_class(key)), entry)
}

fn prefix_name<F: Family>((bits, addr): &LpmKey<F>) -> String {
    format!("{}/{bits}", F::ip(addr))
}

/// A source-ranges key: the service id (big-endian), then the range's address.
fn source_range_name<F: Family>((bits, data): &LpmKey<F::RangeData>) -> String {
    let (service_id, ip) = F::source_range_parts(data);
    format!("service {service_id} from {ip}/{}", bits.saturating_sub(32))
}

impl Entries {
    /// What the agent's encoding `wanted` puts in the maps.
    pub fn wanted(wanted: &Wanted) -> Self {
        let mut entries = Self::default();
        entries.add_wanted(&wanted.v4);
        entries.add_wanted(&wanted.v6);
        entries
    }

    fn add_wanted<F: Family>(&mut self, wanted: &FamilyWanted<F>) {
        self.services.extend(wanted.services.iter().map(|(key, service)| service_entry::<F>(key, service)));
        self.add_classifiers(wanted);
    }

    fn add_classifiers<F: Family>(&mut self, wanted: &FamilyWanted<F>) {
        let maps = F::MAPS;
        self.add_classifier(
            maps.node_ips,
            wanted.node_ips.iter().map(|(addr, v)| (F::ip(addr).to_string(), *v)),
        );
        self.add_classifier(maps.pod_cidrs, wanted.pod_cidrs.iter().map(|(k, v)| (prefix_name::<F>(k), *v)));
        self.add_classifier(maps.unmatched, wanted.unmatched.iter().map(|(k, v)| (prefix_name::<F>(k), *v)));
        self.add_classifier(
            maps.source_ranges,
            wanted.source_ranges.iter().map(|(k, v)| (source_range_name::<F>(k), *v)),
        );
    }

    fn add_classifier(&mut self, map: &str, entries: impl Iterator<Item = (String, u8)>) {
        // Every map is listed, an empty one too, so that "empty" and "not recorded" differ.
        self.classifiers.entry(map.to_owned()).or_default().extend(entries);
    }

    /// What the maps pinned in `pin_dir` hold.
    pub fn pinned(pin_dir: &Path) -> anyhow::Result<Self> {
        let mut entries = Self::default();
        entries.add_pinned::<V4>(pin_dir)?;
        entries.add_pinned::<V6>(pin_dir)?;
        Ok(entries)
    }

    fn add_pinned<F: Family>(&mut self, pin_dir: &Path) -> anyhow::Result<()> {
        let maps = F::MAPS;
        let services: HashMap<MapData, ServiceKey<F>, Service> = open(pin_dir, maps.services, Map::HashMap)?;
        let backends: HashMap<MapData, BackendSlot, Backend<F>> = open(pin_dir, maps.backends, Map::HashMap)?;
        let mut slots: BTreeMap<u32, BTreeMap<u32, Backend<F>>> = BTreeMap::new();
        for (slot, backend) in backends.entries() {
            slots.entry(slot.backend_set).or_default().insert(slot.slot, backend);
        }
        for (key, service) in services.entries() {
            let set = slots.get(&service.backend_set);
            let backends = (0..service.backend_count)
                .map_while(|slot| set?.get(&slot))
                .map(|backend| {
                    let (ip, port, _counter) = F::backend_parts(backend);
                    SocketAddr::new(ip, port)
                })
                .collect();
            self.services.insert(
                service_key_name::<F>(&key, F::source_class(&key)),
                ServiceEntry {
                    service_id: service.service_id,
                    flags: service.flags,
                    affinity_timeout: service.affinity_timeout,
                    backends,
                },
            );
        }
        let node_ips: HashMap<MapData, F, u8> = open(pin_dir, maps.node_ips, Map::HashMap)?;
        self.add_classifier(
            maps.node_ips,
            node_ips.entries().into_iter().map(|(a, v)| (F::ip(&a).to_string(), v)),
        );
        let pod_cidrs: LpmTrie<MapData, F, u8> = open(pin_dir, maps.pod_cidrs, Map::LpmTrie)?;
        self.add_classifier(
            maps.pod_cidrs,
            pod_cidrs.entries().into_iter().map(|(k, v)| (prefix_name::<F>(&k), v)),
        );
        let unmatched: LpmTrie<MapData, F, u8> = open(pin_dir, maps.unmatched, Map::LpmTrie)?;
        self.add_classifier(
            maps.unmatched,
            unmatched.entries().into_iter().map(|(k, v)| (prefix_name::<F>(&k), v)),
        );
        let ranges: LpmTrie<MapData, F::RangeData, u8> = open(pin_dir, maps.source_ranges, Map::LpmTrie)?;
        self.add_classifier(
            maps.source_ranges,
            ranges.entries().into_iter().map(|(k, v)| (source_range_name::<F>(&k), v)),
        );
        Ok(())
    }
}

fn open<M: TryFrom<Map, Error = aya::maps::MapError>>(
    pin_dir: &Path,
    name: &str,
    kind: fn(MapData) -> Map,
) -> anyhow::Result<M> {
    let pin = pin_dir.join(name);
    let data = MapData::from_pin(&pin).with_context(|| format!("cannot open {}", pin.display()))?;
    M::try_from(kind(data)).with_context(|| format!("{} does not have the expected layout", pin.display()))
}

/// One entry that differs between the record and the pins.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Difference {
    /// `services` for the services maps (both families), else the map's name.
    pub map: String,
    pub key: String,
    /// `missing` (wanted, not in the kernel), `extra` (in the kernel, not wanted) or
    /// `different`.
    pub kind: &'static str,
    /// The entry as the agent wants it and as the kernel holds it (none where absent).
    pub wanted: Option<String>,
    pub kernel: Option<String>,
}

/// Every entry of `wanted` and `kernel` that differs, services first, each group by key.
pub fn compare(wanted: &Entries, kernel: &Entries) -> Vec<Difference> {
    let mut differences = differ("services", &wanted.services, &kernel.services, ToString::to_string);
    let empty = BTreeMap::new();
    let maps: std::collections::BTreeSet<&String> =
        wanted.classifiers.keys().chain(kernel.classifiers.keys()).collect();
    for map in maps {
        let want = wanted.classifiers.get(map).unwrap_or(&empty);
        let have = kernel.classifiers.get(map).unwrap_or(&empty);
        differences.extend(differ(map, want, have, |value| classifier_value(map, *value)));
    }
    differences
}

fn classifier_value(map: &str, value: u8) -> String {
    if map == pins::UNMATCHED4 || map == pins::UNMATCHED6 {
        match value {
            unmatched::REJECT => return "reject".to_owned(),
            unmatched::DROP => return "drop".to_owned(),
            _ => {}
        }
    }
    value.to_string()
}

fn differ<V: PartialEq>(
    map: &str,
    wanted: &BTreeMap<String, V>,
    kernel: &BTreeMap<String, V>,
    show: impl Fn(&V) -> String,
) -> Vec<Difference> {
    let keys: std::collections::BTreeSet<&String> = wanted.keys().chain(kernel.keys()).collect();
    keys.into_iter()
        .filter_map(|key| {
            let (want, have) = (wanted.get(key), kernel.get(key));
            let kind = match (want, have) {
                (Some(want), Some(have)) if want == have => return None,
                (Some(_), Some(_)) => "different",
                (Some(_), None) => "missing",
                (None, _) => "extra",
            };
            Some(Difference {
                map: map.to_owned(),
                key: key.clone(),
                kind,
                wanted: want.map(&show),
                kernel: have.map(&show),
            })
        })
        .collect()
}

/// The record as written: borrows its entries.
#[derive(Serialize)]
struct RecordRef<'a> {
    format: u32,
    pin_dir: &'a Path,
    written_unix_seconds: u64,
    base: u64,
    entries: &'a Entries,
}

/// Writes the record `base` of `entries` for `pin_dir` to `path`, whole or not at all;
/// returns its size.
fn write(path: &Path, pin_dir: &Path, base: u64, entries: &Entries) -> anyhow::Result<u64> {
    let record = RecordRef {
        format: FORMAT,
        pin_dir,
        written_unix_seconds: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_secs()),
        base,
        entries,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = PathBuf::from(temporary);
    let written = std::fs::File::create(&temporary).and_then(|file| {
        let mut file = std::io::BufWriter::new(file);
        serde_json::to_writer(&mut file, &record)?;
        file.write_all(b"\n")?;
        let file = file.into_inner().map_err(|error| error.into_error())?;
        file.sync_all()?;
        file.metadata().map(|metadata| metadata.len())
    });
    written
        .and_then(|size| std::fs::rename(&temporary, path).map(|()| size))
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Reads the record at `path`.
pub fn read(path: &Path) -> anyhow::Result<Record> {
    let text = std::fs::read(path).with_context(|| {
        format!("cannot read {} (the agent writes it after each sync in ebpf mode)", path.display())
    })?;
    let record: Record = serde_json::from_slice(&text)
        .with_context(|| format!("{} is not a desired-state record", path.display()))?;
    anyhow::ensure!(
        record.format == FORMAT,
        "{} has format {}, this vipr reads {FORMAT}",
        path.display(),
        record.format
    );
    let mut record = record;
    // The journal's lines that follow this record, up to the first that is not whole (an
    // agent stopped mid-write).
    if let Ok(journal) = std::fs::read(journal_path(path)) {
        for line in journal.split(|byte| *byte == b'\n').filter(|line| !line.is_empty()) {
            let Ok(delta) = serde_json::from_slice::<Delta>(line) else { break };
            if delta.base == record.base {
                delta.apply(&mut record.entries);
            }
        }
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(backends: &[&str]) -> ServiceEntry {
        ServiceEntry {
            service_id: 1,
            flags: service_flags::REJECT_WHEN_EMPTY,
            affinity_timeout: 0,
            backends: backends.iter().map(|backend| backend.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn compares_entry_by_entry() {
        let mut wanted = Entries::default();
        wanted
            .services
            .insert("TCP 10.96.0.10:80 from pod".into(), entry(&["10.1.0.2:8080", "10.1.0.3:8080"]));
        wanted.services.insert("TCP 10.96.0.10:80 from node".into(), entry(&["10.1.0.2:8080"]));
        wanted.services.insert("UDP 10.96.0.10:53 from pod".into(), entry(&[]));
        wanted
            .classifiers
            .insert(pins::UNMATCHED4.into(), [("10.96.0.10/32".to_owned(), unmatched::REJECT)].into());
        assert!(compare(&wanted, &wanted).is_empty());

        let mut kernel = wanted.clone();
        kernel.services.remove("UDP 10.96.0.10:53 from pod");
        kernel.services.insert("TCP 10.96.0.10:80 from node".into(), entry(&["10.1.0.9:8080"]));
        kernel.services.insert("TCP 10.96.0.11:80 from pod".into(), entry(&[]));
        kernel.classifiers.insert(pins::UNMATCHED4.into(), BTreeMap::new());
        let found: Vec<(String, &str)> =
            compare(&wanted, &kernel).into_iter().map(|d| (d.key, d.kind)).collect();
        assert_eq!(
            found,
            [
                ("TCP 10.96.0.10:80 from node".to_owned(), "different"),
                ("TCP 10.96.0.11:80 from pod".to_owned(), "extra"),
                ("UDP 10.96.0.10:53 from pod".to_owned(), "missing"),
                ("10.96.0.10/32".to_owned(), "missing"),
            ]
        );
        let missing = &compare(&wanted, &kernel)[3];
        assert_eq!(missing.wanted.as_deref(), Some("reject"));
    }

    #[test]
    fn an_entry_reads_like_ipvsadm() {
        let mut maglev = entry(&["10.1.0.2:8080", "10.1.0.3:8080", "10.1.0.2:8080"]);
        maglev.affinity_timeout = 30;
        assert_eq!(
            maglev.to_string(),
            "service 1 [reject-when-empty] affinity 30s -> 10.1.0.2:8080×2 10.1.0.3:8080"
        );
        assert_eq!(entry(&[]).to_string(), "service 1 [reject-when-empty,rejects] -> no backends");
    }

    #[test]
    fn the_record_is_written_whole_and_read_back() {
        let dir = std::env::temp_dir().join(format!("vipr-record-test-{}", std::process::id()));
        let path = path(&dir.join("state"), Path::new("/sys/fs/bpf"));
        assert!(path.ends_with("state/ebpf-desired-state-sys-fs-bpf.json"), "{}", path.display());
        let mut entries = Entries::default();
        entries.services.insert("TCP 10.96.0.10:80 from pod".into(), entry(&["10.1.0.2:8080"]));
        Recorder::new(path.clone(), Path::new("/sys/fs/bpf/vipr")).write_whole(&entries).unwrap();
        let record = read(&path).unwrap();
        assert_eq!(record.entries, entries);
        assert_eq!(record.pin_dir, Path::new("/sys/fs/bpf/vipr"));
        assert!(!path.with_extension("json.tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A sync appends what it changed; the reader replays the journal over the record, stops
    /// at a line an interrupted agent left half written, skips lines of an earlier record, and
    /// a journal that would outgrow the record asks for a whole one.
    #[test]
    fn the_journal_replays_each_syncs_changes_over_the_record() {
        let dir = std::env::temp_dir().join(format!("vipr-journal-test-{}", std::process::id()));
        let path = dir.join("record.json");
        let mut recorder = Recorder::new(path.clone(), Path::new("/sys/fs/bpf/vipr"));
        let mut entries = Entries::default();
        entries.services.insert("TCP 10.96.0.10:80 from pod".into(), entry(&["10.1.0.2:8080"]));
        entries.services.insert("TCP 10.96.0.11:80 from pod".into(), entry(&["10.1.0.3:8080"]));
        recorder.write_whole(&entries).unwrap();
        let base = read(&path).unwrap().base;

        let mut delta = Delta::default();
        delta.services.insert("TCP 10.96.0.10:80 from pod".into(), Some(entry(&["10.1.0.9:8080"])));
        delta.services.insert("TCP 10.96.0.11:80 from pod".into(), None);
        assert!(recorder.append(delta).unwrap());
        let classifiers = Delta {
            classifiers: Some([(pins::NODE_IPS4.to_owned(), [("10.0.0.1".to_owned(), 1)].into())].into()),
            ..Delta::default()
        };
        assert!(recorder.append(classifiers).unwrap());
        let mut expected = Entries::default();
        expected.services.insert("TCP 10.96.0.10:80 from pod".into(), entry(&["10.1.0.9:8080"]));
        expected.classifiers.insert(pins::NODE_IPS4.into(), [("10.0.0.1".to_owned(), 1)].into());
        assert_eq!(read(&path).unwrap().entries, expected);

        // A line of another record, then one cut short: neither applies.
        let stale = Delta {
            base: base ^ 1,
            services: [("TCP 10.96.0.12:80 from pod".into(), None)].into(),
            classifiers: None,
        };
        let mut journal = std::fs::OpenOptions::new().append(true).open(journal_path(&path)).unwrap();
        let mut line = serde_json::to_vec(&stale).unwrap();
        line.push(b'\n');
        journal.write_all(&line).unwrap();
        journal.write_all(br#"{"base":1,"services":{"TCP 10.96.0.10:80"#).unwrap();
        assert_eq!(read(&path).unwrap().entries, expected);

        // Past the journal's limit the recorder refuses to append; the whole record then
        // starts an empty journal.
        recorder.journal_bytes = JOURNAL_MIN_LIMIT;
        assert!(!recorder.append(Delta::default()).unwrap());
        recorder.write_whole(&expected).unwrap();
        assert_eq!(std::fs::metadata(journal_path(&path)).unwrap().len(), 0);
        assert_eq!(read(&path).unwrap().entries, expected);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
