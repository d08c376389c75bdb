//! SCTP's checksum (CRC32c, RFC 9260 appendix A), and how it changes when a NAT rewrites the
//! ports.
//!
//! The checksum covers the SCTP packet only, not an IP pseudo header, so an address change
//! leaves it alone. A port change would need the whole packet read again, which a BPF
//! program cannot afford per packet (Cilium refuses SCTP services whose target port differs
//! from their port for this reason). CRC32c is linear over GF(2), though: for two packets of
//! equal length, `crc(a) ^ crc(b)` is the initial-value-free CRC of `a ^ b`, and `a ^ b` is
//! zero but for the four port bytes. That CRC is the port difference times x^(8·length)
//! modulo the polynomial, which [`port_change`] computes with two table lookups and two
//! carry-less multiplications, independent of the packet's content.
//!
//! Polynomials are in the reflected form the CRC uses: bit 31 is the coefficient of x^0.

/// CRC32c's polynomial (Castagnoli), reflected.
const POLY: u32 = 0x82f6_3b78;
/// x^0, the multiplicative identity.
const ONE: u32 = 1 << 31;

/// `a · b mod POLY`. Without data-dependent branches: the verifier walks every branch of a
/// BPF program, and 64 of them per multiplication would multiply its work.
#[inline(always)]
pub const fn multiply(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut bit = 0;
    while bit < 32 {
        product ^= b & 0u32.wrapping_sub((a >> (31 - bit)) & 1);
        b = (b >> 1) ^ (POLY & 0u32.wrapping_sub(b & 1));
        bit += 1;
    }
    product
}

/// Powers x^(8·n) for n in `0..256` times `step`, i.e. x^(8·step·n).
const fn powers(step: u32) -> [u32; 256] {
    // x^8, then squared as often as `step` (a power of two) needs.
    let mut base = 1u32 << 23;
    let mut doubled = 1;
    while doubled < step {
        base = multiply(base, base);
        doubled *= 2;
    }
    let mut table = [0u32; 256];
    table[0] = ONE;
    let mut n = 1;
    while n < 256 {
        table[n] = multiply(table[n - 1], base);
        n += 1;
    }
    table
}

/// x^(8·n) and x^(8·256·n) (per byte and per 256-byte block): a length below 64 KiB is one
/// entry of each.
static BYTE_POWERS: [u32; 256] = powers(1);
static BLOCK_POWERS: [u32; 256] = powers(256);

/// x^(8·bytes) mod POLY, for `bytes` below 64 KiB (an IP packet): the effect of `bytes` zero
/// bytes on a CRC register.
#[inline(always)]
pub fn x_pow_bytes(bytes: u32) -> u32 {
    multiply(BYTE_POWERS[(bytes & 0xff) as usize], BLOCK_POWERS[((bytes >> 8) & 0xff) as usize])
}

/// What to XOR into the checksum field (read as a little-endian `u32`, the order SCTP
/// stores it in) when the ports change from `old` to `new` (the first four bytes of the
/// header, as they lie in the packet) in an SCTP packet of `length` bytes (header and
/// chunks).
#[inline(always)]
pub fn port_change(old: [u8; 4], new: [u8; 4], length: u32) -> u32 {
    header_change(u32::from_le_bytes(old) ^ u32::from_le_bytes(new), length)
}

/// [`port_change`] from the XOR of the old and new first four bytes, read little-endian.
#[inline(always)]
pub fn header_change(difference: u32, length: u32) -> u32 {
    if difference == 0 {
        return 0;
    }
    multiply(difference, x_pow_bytes(length))
}

/// The checksum of an SCTP packet whose checksum field (bytes 8..12) is zero, as a value
/// to store little-endian. For tests and the conformance runner's raw SCTP client; the
/// datapath never reads a whole packet.
pub fn checksum(packet: &[u8]) -> u32 {
    let mut crc = u32::MAX;
    for &byte in packet {
        crc ^= u32::from(byte);
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ POLY } else { crc >> 1 };
            bit += 1;
        }
    }
    !crc
}

/// Offset of the checksum in the SCTP common header.
pub const CHECKSUM_OFFSET: usize = 8;
/// The common header: ports, verification tag, checksum.
pub const HEADER_LEN: usize = 12;

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 3720 B.4's CRC32c test vector: 32 bytes of zeros.
    #[test]
    fn checksum_matches_the_published_vector() {
        assert_eq!(checksum(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(checksum(b"123456789"), 0xe306_9283);
    }

    fn with_checksum(mut packet: [u8; 64], length: usize) -> [u8; 64] {
        packet[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 4].fill(0);
        let sum = checksum(&packet[..length]);
        packet[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 4].copy_from_slice(&sum.to_le_bytes());
        packet
    }

    #[test]
    fn port_change_matches_a_full_recomputation() {
        // A deterministic spread of contents, lengths and port pairs (xorshift).
        let mut state = 0x9e37_79b9_u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        for round in 0..200 {
            let mut packet = [0u8; 64];
            for byte in packet.iter_mut() {
                *byte = next() as u8;
            }
            let length = HEADER_LEN + (round % (64 - HEADER_LEN + 1));
            let before = with_checksum(packet, length);
            let new_ports = next().to_ne_bytes();
            let mut after = before;
            after[..4].copy_from_slice(&new_ports);
            let expected = with_checksum(after, length);

            let old_ports = [before[0], before[1], before[2], before[3]];
            let stored = u32::from_le_bytes([before[8], before[9], before[10], before[11]]);
            let updated = stored ^ port_change(old_ports, new_ports, length as u32);
            assert_eq!(updated.to_le_bytes(), expected[8..12], "length {length}, round {round}");
        }
    }

    #[test]
    fn unchanged_ports_change_nothing() {
        assert_eq!(port_change([1, 2, 3, 4], [1, 2, 3, 4], 1500), 0);
    }

    #[test]
    fn long_packets_use_every_power() {
        // x^(8·n) from the table equals n zero bytes run through the register one at a time.
        for bytes in [0u32, 1, 2, 3, 255, 256, 1500, 9000, 65535] {
            let mut register = ONE;
            for _ in 0..bytes * 8 {
                register = if register & 1 != 0 { (register >> 1) ^ POLY } else { register >> 1 };
            }
            assert_eq!(x_pow_bytes(bytes), register, "{bytes} bytes");
        }
    }
}
