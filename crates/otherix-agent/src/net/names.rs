//! Interface-name validation and MAC formatting.
//!
//! Names come from the caller (the control plane's desired state); we only check that
//! the kernel will take them, so a bad name fails with a clear error before any
//! netlink request rather than as an opaque `EINVAL` halfway through a reconcile.

use super::NetError;

/// Longest interface name the kernel accepts (`IFNAMSIZ` minus the NUL).
pub const IFNAME_MAX: usize = 15;

/// Checks that `name` is a valid Linux interface name.
pub fn validate_ifname(name: &str) -> Result<(), NetError> {
    let reason = if name.is_empty() {
        Some("empty")
    } else if name.len() > IFNAME_MAX {
        Some("longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("reserved")
    } else if name
        .bytes()
        .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace() || b == 0)
    {
        Some("contains '/', ':', whitespace or NUL")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(NetError::InvalidName {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// Formats a MAC as `02:00:0a:d6:00:0a`.
pub fn fmt_mac(mac: &[u8; 6]) -> String {
    let [a, b, c, d, e, f] = mac;
    format!("{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{f:02x}")
}

/// Parses a 6-byte link-layer address attribute.
pub(crate) fn mac_from(bytes: &[u8]) -> Option<[u8; 6]> {
    bytes.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifteen_byte_name_is_accepted_sixteen_is_refused() {
        assert!(validate_ifname("abcdefghijklmno").is_ok());
        let err = validate_ifname("abcdefghijklmnop").unwrap_err();
        assert!(err.to_string().contains("longer than 15 bytes"), "{err}");
    }

    #[test]
    fn empty_slash_and_space_names_are_refused() {
        for bad in ["", ".", "..", "a/b", "a b", "br:0"] {
            assert!(validate_ifname(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn mac_is_formatted_lowercase_colon_separated() {
        assert_eq!(fmt_mac(&[0x02, 0, 0x0a, 0xd6, 0, 0xff]), "02:00:0a:d6:00:ff");
    }
}
