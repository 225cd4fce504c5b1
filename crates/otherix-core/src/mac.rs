//! Ethernet MAC addresses for VM interfaces: text form and generation.
//!
//! Generated addresses are locally administered unicast (first octet 0x02),
//! so they can never collide with a vendor-assigned address; the random
//! bytes come from the caller, keeping this crate free of randomness sources.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A 48-bit MAC address, written `02:ab:cd:ef:01:23`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(try_from = "String")]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// The address as written (`02:ab:cd:ef:01:23`), without allocating:
    /// desired states carry tens of thousands of them.
    pub fn text(&self) -> MacText {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = [b':'; 17];
        for (i, b) in self.0.iter().enumerate() {
            out[i * 3] = HEX[usize::from(b >> 4)];
            out[i * 3 + 1] = HEX[usize::from(b & 0xf)];
        }
        MacText(out)
    }
}

/// A MAC address's text, on the stack (see [`MacAddr::text`]).
#[derive(Clone, Copy)]
pub struct MacText([u8; 17]);

impl MacText {
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits and ':' are ever written.
        std::str::from_utf8(&self.0).unwrap_or("")
    }
}

impl Serialize for MacAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.text().as_str())
    }
}

/// A MAC address the caller wrote was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum MacError {
    /// Not six `:`-separated groups.
    #[error(
        "invalid MAC address {input:?}: expected 6 groups of two hex digits separated by ':' \
         (such as 02:ab:cd:ef:01:23), found {groups}"
    )]
    WrongGroupCount {
        /// The refused text.
        input: String,
        /// How many `:`-separated groups it has.
        groups: usize,
    },
    /// A group is not exactly two hex digits.
    #[error(
        "invalid group {group:?} at position {position} in MAC address {input:?}; \
         expected two hex digits"
    )]
    InvalidGroup {
        /// The refused text.
        input: String,
        /// The offending group.
        group: String,
        /// 0-based character index of the group's start in `input`.
        position: usize,
    },
}

impl MacAddr {
    /// The prefix of generated addresses: locally administered (bit 1 set),
    /// unicast (bit 0 clear).
    const GENERATED_FIRST_OCTET: u8 = 0x02;

    /// A locally administered unicast address: `02` followed by `bytes`,
    /// which the caller draws from a random source.
    pub fn from_random(bytes: [u8; 5]) -> MacAddr {
        let [a, b, c, d, e] = bytes;
        MacAddr([Self::GENERATED_FIRST_OCTET, a, b, c, d, e])
    }

    /// Whether the address is locally administered and unicast, as every
    /// address we generate is.
    pub fn is_locally_administered_unicast(&self) -> bool {
        let first = self.0[0];
        first & 0x02 != 0 && first & 0x01 == 0
    }

    /// The six octets.
    pub fn octets(&self) -> [u8; 6] {
        self.0
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.text().as_str())
    }
}

impl FromStr for MacAddr {
    type Err = MacError;

    /// Accepts six `:`-separated groups of exactly two hex digits, in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let groups = s.split(':').count();
        if groups != 6 {
            return Err(MacError::WrongGroupCount {
                input: s.to_owned(),
                groups,
            });
        }
        let mut octets = [0u8; 6];
        let mut position = 0;
        for (octet, group) in octets.iter_mut().zip(s.split(':')) {
            let invalid = || MacError::InvalidGroup {
                input: s.to_owned(),
                group: group.to_owned(),
                position,
            };
            // Checking the digits first also refuses the '+' that
            // `from_str_radix` would accept.
            if group.len() != 2 || !group.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(invalid());
            }
            *octet = u8::from_str_radix(group, 16).map_err(|_| invalid())?;
            position += group.chars().count() + 1;
        }
        Ok(MacAddr(octets))
    }
}

impl TryFrom<String> for MacAddr {
    type Error = MacError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<MacAddr> for String {
    fn from(mac: MacAddr) -> Self {
        mac.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde::de::value::{Error as DeError, StrDeserializer};
    use serde::de::IntoDeserializer;

    #[test]
    fn display_is_lowercase_colon_separated() {
        let mac = MacAddr([0x02, 0xAB, 0xCD, 0xEF, 0x01, 0x23]);
        assert_eq!(mac.to_string(), "02:ab:cd:ef:01:23");
    }

    #[test]
    fn parsing_is_case_insensitive() {
        let expected = MacAddr([0x02, 0xab, 0xcd, 0xef, 0x01, 0x23]);
        assert_eq!("02:AB:cd:Ef:01:23".parse(), Ok(expected));
    }

    #[test]
    fn wrong_group_count_is_refused() {
        let err = "02:ab:cd:ef:01".parse::<MacAddr>().unwrap_err();
        assert_eq!(
            err,
            MacError::WrongGroupCount {
                input: "02:ab:cd:ef:01".into(),
                groups: 5
            }
        );
        assert_eq!(
            err.to_string(),
            "invalid MAC address \"02:ab:cd:ef:01\": expected 6 groups of two hex digits \
             separated by ':' (such as 02:ab:cd:ef:01:23), found 5"
        );
        assert!(matches!(
            "02-ab-cd-ef-01-23".parse::<MacAddr>(),
            Err(MacError::WrongGroupCount { groups: 1, .. })
        ));
        assert!(matches!(
            "02:ab:cd:ef:01:23:45".parse::<MacAddr>(),
            Err(MacError::WrongGroupCount { groups: 7, .. })
        ));
    }

    #[test]
    fn non_hex_group_is_refused_with_its_position() {
        let err = "02:ab:cd:eg:01:23".parse::<MacAddr>().unwrap_err();
        assert_eq!(
            err,
            MacError::InvalidGroup {
                input: "02:ab:cd:eg:01:23".into(),
                group: "eg".into(),
                position: 9
            }
        );
        assert_eq!(
            err.to_string(),
            "invalid group \"eg\" at position 9 in MAC address \"02:ab:cd:eg:01:23\"; \
             expected two hex digits"
        );
    }

    #[test]
    fn groups_must_have_exactly_two_digits() {
        for (input, group, position) in [
            ("2:ab:cd:ef:01:23", "2", 0),
            ("02:ab:cd:ef:01:234", "234", 15),
            ("02:ab::ef:01:23", "", 6),
            ("02:+a:cd:ef:01:23", "+a", 3),
            ("02:ab:cd:ef:01:2é", "2é", 15),
        ] {
            assert_eq!(
                input.parse::<MacAddr>(),
                Err(MacError::InvalidGroup {
                    input: input.into(),
                    group: group.into(),
                    position
                }),
                "{input}"
            );
        }
    }

    #[test]
    fn random_mac_is_locally_administered_unicast() {
        let mac = MacAddr::from_random([0xff, 1, 2, 3, 4]);
        assert_eq!(mac, MacAddr([0x02, 0xff, 1, 2, 3, 4]));
        assert!(mac.is_locally_administered_unicast());
    }

    #[test]
    fn vendor_and_multicast_macs_are_not_locally_administered_unicast() {
        assert!(!MacAddr([0x00, 0x1b, 0x21, 0, 0, 1]).is_locally_administered_unicast());
        assert!(!MacAddr([0x03, 0, 0, 0, 0, 1]).is_locally_administered_unicast());
        assert!(!MacAddr([0x01, 0x00, 0x5e, 0, 0, 1]).is_locally_administered_unicast());
        assert!(MacAddr([0x06, 0, 0, 0, 0, 1]).is_locally_administered_unicast());
    }

    #[test]
    fn mac_deserializes_from_text_and_serializes_as_text() {
        let de: StrDeserializer<'_, DeError> = "02:AB:cd:ef:01:23".into_deserializer();
        let mac = MacAddr::deserialize(de).unwrap();
        assert_eq!(String::from(mac), "02:ab:cd:ef:01:23");
        let de: StrDeserializer<'_, DeError> = "nope".into_deserializer();
        assert!(MacAddr::deserialize(de)
            .unwrap_err()
            .to_string()
            .contains("found 1"));
    }

    proptest! {
        #[test]
        fn display_parses_back(octets in any::<[u8; 6]>()) {
            let mac = MacAddr(octets);
            prop_assert_eq!(mac.to_string().parse(), Ok(mac));
            prop_assert_eq!(mac.to_string().to_uppercase().parse(), Ok(mac));
            // The text is what the old formatting wrote, and JSON carries it.
            let [a, b, c, d, e, g] = octets;
            let want = format!("{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}");
            prop_assert_eq!(mac.to_string(), want.clone());
            let json = serde_json::to_string(&mac).unwrap();
            prop_assert_eq!(&json, &format!("\"{want}\""));
            prop_assert_eq!(serde_json::from_str::<MacAddr>(&json).unwrap(), mac);
        }

        #[test]
        fn every_random_mac_is_locally_administered_unicast(bytes in any::<[u8; 5]>()) {
            let mac = MacAddr::from_random(bytes);
            prop_assert!(mac.is_locally_administered_unicast());
            prop_assert_eq!(&mac.octets()[1..], &bytes[..]);
        }

        #[test]
        fn arbitrary_text_never_panics(s in "[0-9a-fA-F:+é]{0,20}|.{0,20}") {
            let _ = s.parse::<MacAddr>();
        }
    }
}
