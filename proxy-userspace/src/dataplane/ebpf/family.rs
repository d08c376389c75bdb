//! IPv4 and IPv6 as the maps see them: each family has its own set of maps (`vipr_*4_v*`,
//! `vipr_*6_v*`) with the same meaning, so encoding, planning and syncing are written once,
//! generic over [`Family`], and run for both. The family description itself is proxy-common's,
//! shared with the kernel programs and the tests.
pub use proxy_common::family::{Family, V4, V6};

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use ipnet::IpNet;

    use super::*;

    #[test]
    fn keys_of_each_family() {
        let v4: IpAddr = "10.96.0.10".parse().unwrap();
        let v6: IpAddr = "fd00:10:96::a".parse().unwrap();
        assert_eq!(V4::addr(v4), Some([10, 96, 0, 10]));
        assert_eq!(V4::addr(v6), None);
        assert_eq!(V6::addr(v4), None);
        assert_eq!(V6::ip(&V6::addr(v6).unwrap()), v6);
        assert_eq!(V6::frontend(&V6::service_key(V6::addr(v6).unwrap(), 80, 6, 1)), (v6, 80, 6));

        let range: IpNet = "2001:db8::/32".parse().unwrap();
        let (bits, data) = V6::source_range(0x0102_0304, &range).unwrap();
        assert_eq!(bits, 64);
        assert_eq!(data[..6], [1, 2, 3, 4, 0x20, 0x01]);
        assert_eq!(V4::source_range(7, &range), None);
        assert_eq!(
            V4::source_range(7, &"10.0.0.0/8".parse().unwrap()),
            Some((40, [0, 0, 0, 7, 10, 0, 0, 0]))
        );
        assert_eq!(V6::prefix(&"fd00:10::/64".parse().unwrap()).map(|(bits, _)| bits), Some(64));
    }
}
