use std::{net::SocketAddr, process::Command};

use super::*;
use crate::dataplane::nftables::{ruleset, NftablesDataplane, NftablesOptions, Writer};
use crate::dataplane::Dataplane as _;
use crate::model::{fixtures, DesiredState, Frontend, FrontendEntry, FrontendKind, Protocol};

const VERDICT_MAP: &str = "type ipv4_addr . inet_proto . inet_service : verdict ;";
const ENDPOINT_MAP: &str = "typeof ip daddr . tcp dport . numgen random mod 1 : ip daddr . tcp dport ;";

fn change(set: &str, spec: &str, delete: bool, elements: &[(&str, Option<&str>)]) -> ElementChange {
    ElementChange {
        set: set.into(),
        spec: spec.into(),
        delete,
        elements: elements.iter().map(|(key, value)| ((*key).into(), value.map(str::to_owned))).collect(),
    }
}

/// The golden bytes are those `nft --debug=mnl` sends for `add element ip t v { 10.0.0.1 .
/// tcp . 80 : goto c }` (nft 1.0.6), with vipr's table and set names, without the
/// `NFTA_SET_ELEM_LIST_SET_ID` nft adds, and with the acknowledgement and create flags.
#[test]
fn one_verdict_map_element_is_encoded_as_nft_sends_it() {
    let changes = [change("v", VERDICT_MAP, false, &[("10.0.0.1 . tcp . 80", Some("goto c"))])];
    let batch =
        ElementBatch::encode(Family::Ipv4, changes.iter().map(ElementChange::view).collect(), 1).unwrap();
    #[rustfmt::skip]
    let expected: Vec<u8> = [
        // NFNL_MSG_BATCH_BEGIN, request, seq 1; nfgenmsg: AF_UNSPEC, v0, res_id NFNL_SUBSYS_NFTABLES.
        &20u32.to_ne_bytes()[..], &0x10u16.to_ne_bytes(), &1u16.to_ne_bytes(), &1u32.to_ne_bytes(), &[0, 0, 0, 0],
        &[0, 0, 0, 10],
        // NFT_MSG_NEWSETELEM, request | ack | create, seq 2; nfgenmsg: NFPROTO_IPV4.
        &92u32.to_ne_bytes(), &0x0a0cu16.to_ne_bytes(), &0x405u16.to_ne_bytes(), &2u32.to_ne_bytes(), &[0, 0, 0, 0],
        &[2, 0, 0, 0],
        &[9, 0, 1, 0], b"vipr\0", &[0, 0, 0],                 // NFTA_SET_ELEM_LIST_TABLE
        &[6, 0, 2, 0], b"v\0", &[0, 0],                       // NFTA_SET_ELEM_LIST_SET
        &[52, 0, 3, 0x80],                                    // NFTA_SET_ELEM_LIST_ELEMENTS
        &[48, 0, 1, 0x80],                                    //  NFTA_LIST_ELEM
        &[20, 0, 1, 0x80],                                    //   NFTA_SET_ELEM_KEY
        &[16, 0, 1, 0],                                       //    NFTA_DATA_VALUE
        &[10, 0, 0, 1], &[6, 0, 0, 0], &[0, 80, 0, 0],        //     address . protocol . port, each padded to 4
        &[24, 0, 2, 0x80],                                    //   NFTA_SET_ELEM_DATA
        &[20, 0, 2, 0x80],                                    //    NFTA_DATA_VERDICT
        &[8, 0, 1, 0], &[0xff, 0xff, 0xff, 0xfc],             //     NFTA_VERDICT_CODE: NFT_GOTO, big-endian
        &[6, 0, 2, 0], b"c\0", &[0, 0],                       //     NFTA_VERDICT_CHAIN
        // NFNL_MSG_BATCH_END, seq 3.
        &20u32.to_ne_bytes(), &0x11u16.to_ne_bytes(), &1u16.to_ne_bytes(), &3u32.to_ne_bytes(), &[0, 0, 0, 0],
        &[0, 0, 0, 10],
    ]
    .concat();
    assert_eq!(batch.bytes(), expected);
}

/// `nft --debug=netlink` shows `add element ip t m { 10.0.0.1 . 80 . 3 : 10.1.2.3 . 8080 }`
/// as `element 0100000a 00005000 00000003 : 0302010a 0000901f` (32-bit words, host order).
#[test]
fn an_endpoint_map_element_is_a_padded_concatenation_with_the_slot_in_host_order() {
    let layout = Layout::of_spec(ENDPOINT_MAP).unwrap();
    let element = encode_element(&layout, "10.0.0.1 . 80 . 3", Some("10.1.2.3 . 8080"), false).unwrap();
    let words = |bytes: &[u8]| -> Vec<String> {
        bytes.chunks(4).map(|word| format!("{:08x}", u32::from_le_bytes(word.try_into().unwrap()))).collect()
    };
    let attributes: Vec<_> = crate::netlink::parse_attributes(element.bytes()).collect();
    let key = attributes[0].nested().next().unwrap().payload;
    let value = attributes[1].nested().next().unwrap().payload;
    assert_eq!(words(key), ["0100000a", "00005000", "00000003"]);
    assert_eq!(words(value), ["0302010a", "0000901f"]);
    // A deletion names the key alone.
    let deleted = encode_element(&layout, "10.0.0.1 . 80 . 3", None, true).unwrap();
    assert_eq!(crate::netlink::parse_attributes(deleted.bytes()).count(), 1);
}

#[test]
fn what_cannot_be_encoded_is_refused_before_sending() {
    assert_eq!(Layout::of_spec("type ipv4_addr ; flags interval ;"), None, "interval sets need ranges");
    assert_eq!(Layout::of_spec("type mark ;"), None);
    let changes = [change("v", VERDICT_MAP, false, &[("10.0.0.1 . tcp", Some("goto c"))])];
    let refused = ElementBatch::encode(Family::Ipv4, changes.iter().map(ElementChange::view).collect(), 1);
    assert!(matches!(refused, Err(BatchError::Unsupported(_))), "a key with a field missing");
    let changes = [change("s", "type ipv4_addr ;", false, &[("fe80::1", None)])];
    let refused = ElementBatch::encode(Family::Ipv4, changes.iter().map(ElementChange::view).collect(), 1);
    assert!(matches!(refused, Err(BatchError::Unsupported(_))), "an IPv6 address in an IPv4 set");
}

#[test]
fn large_changes_are_split_into_messages_under_64_kib() {
    let elements: Vec<(String, Option<String>)> = (0..5000)
        .map(|i| (format!("10.0.{}.{} . tcp . 80", i / 250, i % 250 + 1), Some(format!("goto service-{i}"))))
        .collect();
    let changes = [ElementChange { set: "v".into(), spec: VERDICT_MAP.into(), delete: false, elements }];
    let batch =
        ElementBatch::encode(Family::Ipv4, changes.iter().map(ElementChange::view).collect(), 1).unwrap();
    assert!(batch.sent.len() > 1, "{} messages", batch.sent.len());
    assert_eq!(batch.sent.iter().map(|sent| sent.elements.len()).sum::<usize>(), 5000);
    for message in crate::netlink::split_messages(batch.bytes()).unwrap() {
        assert!(message.payload.len() < 64 * 1024);
    }
}

/// Runs `body` on a thread of its own in a new network namespace (gone with the thread);
/// the `nft` processes it starts run there too.
fn in_new_netns<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        // SAFETY: changes this thread's network namespace only.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0, "{}", io::Error::last_os_error());
        body()
    })
    .join()
    .unwrap()
}

fn nft(args: &[&str]) -> String {
    let output = Command::new("nft").args(args).output().unwrap();
    assert!(output.status.success(), "nft {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

/// `nft list table ip vipr` with every `elements = { … }` sorted: a hash set lists its
/// elements in its own order.
fn listing() -> String {
    let text = nft(&["list", "table", "ip", ruleset::TABLE]).split_whitespace().collect::<Vec<_>>().join(" ");
    let mut normalized = String::new();
    let mut rest = text.as_str();
    while let Some(start) = rest.find("elements = {") {
        let (before, after) = rest.split_at(start + "elements = {".len());
        normalized.push_str(before);
        let end = after.find('}').unwrap();
        let mut elements: Vec<&str> = after[..end].split(',').map(str::trim).collect();
        elements.sort_unstable();
        normalized.push_str(&elements.join(", "));
        rest = &after[end..];
    }
    normalized.push_str(rest);
    normalized
}

fn entry(name: &str, kind: FrontendKind, backends: &[&str]) -> FrontendEntry {
    fixtures::entry(fixtures::service_port("ns1", name, "p80", Protocol::Tcp), kind, backends)
}

/// Service `a` (cluster IP) with `a_backends`; service `b` (cluster IP and NodePort) with two.
fn state(a_backends: &[&str]) -> DesiredState {
    let mut state = DesiredState::default();
    let b = ["10.2.0.1:8080", "10.2.0.2:8080"];
    for (address, entry) in [
        ("172.30.0.1:80", entry("a", FrontendKind::ClusterIp, a_backends)),
        ("172.30.0.2:80", entry("b", FrontendKind::ClusterIp, &b)),
        ("192.168.0.2:30080", entry("b", FrontendKind::NodePort, &b)),
    ] {
        let frontend: SocketAddr = address.parse().unwrap();
        let frontend = Frontend { ip: frontend.ip(), port: frontend.port(), protocol: Protocol::Tcp };
        if entry.kind == FrontendKind::ClusterIp {
            state.cluster_ips.insert(frontend.ip);
        }
        state.frontends.insert(frontend, entry);
    }
    state.service_cidrs = vec!["172.30.0.0/16".parse().unwrap()];
    state.sources.pod_cidrs = vec!["10.0.0.0/8".parse().unwrap()];
    state
}

fn options() -> NftablesOptions {
    NftablesOptions { conntrack_cleanup: false, ..NftablesOptions::default() }
}

/// The table `nft -f` alone makes for `state` from empty.
fn programmed_by_nft(state: DesiredState) -> String {
    in_new_netns(move || {
        let options = NftablesOptions { netlink_elements: false, ..options() };
        let mut dataplane = NftablesDataplane::start(&options).unwrap();
        assert!(dataplane.sync(&state).unwrap().is_complete());
        listing()
    })
}

#[test]
fn an_endpoint_change_over_netlink_leaves_the_table_nft_would_make() {
    let before = state(&["10.1.0.1:8080", "10.1.0.2:8080"]);
    let after = state(&["10.1.0.1:8080", "10.1.0.3:8080"]);
    let expected = programmed_by_nft(after.clone());
    let (changed, writers) = in_new_netns(move || {
        let mut dataplane = NftablesDataplane::start(&options()).unwrap();
        dataplane.sync(&before).unwrap();
        assert!(dataplane.sync(&after).unwrap().is_complete());
        let writers: Vec<Writer> =
            dataplane.last_sync().batches.iter().map(|applied| applied.writer).collect();
        (listing(), writers)
    });
    assert_eq!(writers, [Writer::Netlink], "the change is elements alone");
    assert_eq!(changed, expected);
}

#[test]
fn a_table_created_from_empty_with_its_elements_over_netlink_is_the_one_nft_makes() {
    let wanted = state(&["10.1.0.1:8080", "10.1.0.2:8080"]);
    let expected = programmed_by_nft(wanted.clone());
    let (created, writers) = in_new_netns(move || {
        let mut dataplane = NftablesDataplane::start(&options()).unwrap();
        assert!(dataplane.sync(&wanted).unwrap().is_complete());
        // The ip table (the ip6 one, without elements, is nft's alone).
        let writers: Vec<Writer> = dataplane
            .last_sync()
            .batches
            .iter()
            .filter(|applied| applied.family == Family::Ipv4)
            .map(|applied| applied.writer)
            .collect();
        (listing(), writers)
    });
    assert_eq!(writers, [Writer::NftThenNetlink]);
    assert_eq!(created, expected);
}

#[test]
fn a_refused_netlink_batch_falls_back_to_a_full_nft_sync() {
    let before = state(&["10.1.0.1:8080", "10.1.0.2:8080"]);
    let after = state(&["10.1.0.1:8080", "10.1.0.3:8080"]);
    let expected = programmed_by_nft(after.clone());
    let (changed, stats, fallbacks) = in_new_netns(move || {
        let mut dataplane = NftablesDataplane::start(&options()).unwrap();
        dataplane.sync(&before).unwrap();
        // Someone else removes an element vipr will delete: the kernel refuses the batch.
        nft(&["delete", "element", "ip", ruleset::TABLE, "hairpin-endpoints", "{ 10.1.0.2 . 10.1.0.2 }"]);
        assert!(dataplane.sync(&after).unwrap().is_complete());
        let metrics: Vec<_> =
            dataplane.collectors().iter().flat_map(|collector| collector.collect()).collect();
        (listing(), dataplane.last_sync().clone(), metrics)
    });
    assert_eq!(stats.netlink_fallbacks, 1);
    // Counted on /metrics.
    let fallbacks = fallbacks.iter().find(|family| family.name == "vipr_nftables_netlink_fallbacks_total");
    assert_eq!(
        fallbacks.map(|family| family.samples[0].value.clone()),
        Some(crate::metrics::SampleValue::Number(1.0)),
        "{fallbacks:?}"
    );
    assert!(stats.batches.iter().all(|applied| applied.writer == Writer::Nft && applied.batch.structural));
    assert_eq!(changed, expected);
}

#[test]
fn a_refused_element_is_named_in_the_error() {
    let error = in_new_netns(|| {
        nft(&["add table ip vipr ; add map ip vipr v { type ipv4_addr . inet_proto . inet_service : verdict ; }"]);
        let changes = [
            change("v", VERDICT_MAP, false, &[("10.0.0.1 . tcp . 80", Some("drop"))]),
            change("v", VERDICT_MAP, true, &[("10.0.0.1 . tcp . 80", None), ("10.0.0.9 . udp . 53", None)]),
        ];
        apply(Family::Ipv4, changes.iter().map(ElementChange::view).collect()).unwrap_err()
    });
    let BatchError::Kernel { error, element, .. } = &error else { panic!("{error}") };
    assert_eq!(error.raw_os_error(), Some(libc::ENOENT), "{error}");
    assert_eq!(element.as_deref(), Some("delete element ip vipr v { 10.0.0.9 . udp . 53 }"));
}

/// A dump's `NFT_MSG_NEWTABLE` messages name the family (nfgenmsg) and the table
/// (`NFTA_TABLE_NAME`); other messages are skipped.
#[test]
fn a_table_dump_is_read_as_family_and_name() {
    let table = |family: u8, name: &str| {
        let mut payload = nfgenmsg(family, 0).to_vec();
        payload.extend_from_slice(Attributes::new().put_str(NFTA_TABLE_NAME, name).put_u32(2, 0).bytes());
        Received { kind: nfnl_type(NFNL_SUBSYS_NFTABLES, NFT_MSG_NEWTABLE), flags: 2, sequence: 1, payload }
    };
    let mut other = table(2, "ignored");
    other.kind = nfnl_type(NFNL_SUBSYS_NFTABLES, 3);
    let replies = [table(2, "vipr"), other, table(10, "kube-proxy")];
    assert_eq!(tables_of(&replies), [(2, "vipr".to_owned()), (10, "kube-proxy".to_owned())]);
}

/// Against the kernel: the families of the tables named `vipr`, whatever else is there.
#[test]
fn the_families_with_vipr_tables_are_read_from_the_kernel() {
    in_new_netns(|| {
        assert_eq!(families_with_table(ruleset::TABLE).unwrap(), []);
        nft(&["add", "table", "ip6", ruleset::TABLE]);
        nft(&["add", "table", "ip", "other"]);
        nft(&["add", "table", "inet", ruleset::TABLE]);
        assert_eq!(families_with_table(ruleset::TABLE).unwrap(), [Family::Ipv6]);
        nft(&["add", "table", "ip", ruleset::TABLE]);
        assert_eq!(families_with_table(ruleset::TABLE).unwrap(), [Family::Ipv4, Family::Ipv6]);
        assert_eq!(crate::dataplane::nftables::tables().unwrap(), [Family::Ipv4, Family::Ipv6]);
    });
}
