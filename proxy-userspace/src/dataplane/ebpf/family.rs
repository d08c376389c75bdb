//! IPv4 and IPv6 as the maps see them: each family has its own set of maps (`vipr_*4_v*`,
//! `vipr_*6_v*`) with the same meaning, so encoding, planning and syncing are written once,
//! generic over [`Family`], and run for both. The family description itself, and its tests, are
//! proxy-common's, shared with the kernel programs and the tests.
pub use proxy_common::family::{Family, V4, V6};
