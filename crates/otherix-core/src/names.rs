//! Validation of object names (VMs, networks, users, nodes, LBs, grants).
//!
//! Names follow the RFC 1123 DNS label rules because a VM's name becomes the
//! host name clients reach it by: anything we accept here must be usable as a
//! DNS label without escaping.

use thiserror::Error;

/// The longest name we accept: the DNS limit for one label.
pub const MAX_NAME_LEN: usize = 63;

/// Why a name was refused. The caller supplied it, so every message says
/// what to change.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum NameError {
    /// The name has no characters at all.
    #[error("name is empty; expected 1 to 63 lowercase letters, digits or '-'")]
    Empty,
    /// The name is longer than a DNS label may be.
    #[error("name is {len} characters long; the limit is 63")]
    TooLong {
        /// Length of the refused name, in characters.
        len: usize,
    },
    /// A character outside `a-z`, `0-9` and `-`.
    #[error(
        "invalid character {ch:?} at position {position} in name {name:?}; \
         expected lowercase letters a-z, digits 0-9 or '-'"
    )]
    InvalidChar {
        /// The refused name.
        name: String,
        /// The offending character.
        ch: char,
        /// 0-based character index of `ch` in `name`.
        position: usize,
    },
    /// The name begins with `-`.
    #[error("name {name:?} must start with a lowercase letter or digit, not '-'")]
    BadStart {
        /// The refused name.
        name: String,
    },
    /// The name ends with `-`.
    #[error("name {name:?} must end with a lowercase letter or digit, not '-'")]
    BadEnd {
        /// The refused name.
        name: String,
    },
}

/// Checks that `name` is a valid RFC 1123 DNS label: 1 to 63 characters of
/// `a-z`, `0-9` and `-`, starting and ending with a letter or digit.
///
/// Problems are reported in the order a reader meets them, left to right, so
/// the first fix the user makes is the one the message points at.
pub fn validate_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    // Counting characters rather than bytes keeps the reported length
    // meaningful for the user even if the name holds non-ASCII text.
    let len = name.chars().count();
    if len > MAX_NAME_LEN {
        return Err(NameError::TooLong { len });
    }
    for (position, ch) in name.chars().enumerate() {
        if position == 0 && ch == '-' {
            return Err(NameError::BadStart {
                name: name.to_owned(),
            });
        }
        if !is_name_char(ch) {
            return Err(NameError::InvalidChar {
                name: name.to_owned(),
                ch,
                position,
            });
        }
    }
    if name.ends_with('-') {
        return Err(NameError::BadEnd {
            name: name.to_owned(),
        });
    }
    Ok(())
}

fn is_name_char(ch: char) -> bool {
    ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '-'
}

/// A name refused for one kind of object: the message says which
/// ("invalid VM name: ...") so a refusal read off a request body points at
/// the field.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid {kind} name: {source}")]
pub struct InvalidName {
    /// What the name was for: "VM", "network", "node", ...
    pub kind: &'static str,
    /// Why it was refused.
    #[source]
    pub source: NameError,
}

/// Defines a validated name of one kind of object. A value of the type is a
/// valid DNS label by construction: it is made only through [`validate_name`]
/// (`new`, `TryFrom<String>`, `FromStr`, deserialization), so code that holds
/// one never checks again, and a VM name cannot be passed where a node name
/// is wanted.
macro_rules! name_type {
    ($(#[$doc:meta])* $ty:ident, $kind:literal, $example:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $ty(String);

        impl $ty {
            /// What the name is for, as refusals say it.
            pub const KIND: &'static str = $kind;

            /// Checks `name` (see [`validate_name`]).
            pub fn new(name: impl Into<String>) -> Result<Self, InvalidName> {
                let name = name.into();
                match validate_name(&name) {
                    Ok(()) => Ok(Self(name)),
                    Err(source) => Err(InvalidName { kind: $kind, source }),
                }
            }

            /// The name as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The name as an owned string.
            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl TryFrom<String> for $ty {
            type Error = InvalidName;
            fn try_from(name: String) -> Result<Self, InvalidName> {
                Self::new(name)
            }
        }

        impl std::str::FromStr for $ty {
            type Err = InvalidName;
            fn from_str(name: &str) -> Result<Self, InvalidName> {
                Self::new(name)
            }
        }

        impl From<$ty> for String {
            fn from(name: $ty) -> String {
                name.0
            }
        }

        impl std::ops::Deref for $ty {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $ty {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl std::borrow::Borrow<str> for $ty {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        /// As the string it is (`"web01"`), so messages that quote a name
        /// with `{:?}` read the same whatever its type.
        impl std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                std::fmt::Debug::fmt(&self.0, f)
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl PartialEq<str> for $ty {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $ty {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<$ty> for str {
            fn eq(&self, other: &$ty) -> bool {
                self == other.0
            }
        }

        impl PartialEq<$ty> for &str {
            fn eq(&self, other: &$ty) -> bool {
                *self == other.0
            }
        }

        #[cfg(feature = "schema")]
        impl utoipa::PartialSchema for $ty {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                crate::schema::name_schema(concat!("The name of a ", $kind, ": a DNS label."), $example)
            }
        }

        #[cfg(feature = "schema")]
        impl utoipa::ToSchema for $ty {
            fn name() -> std::borrow::Cow<'static, str> {
                std::borrow::Cow::Borrowed(stringify!($ty))
            }
        }
    };
}

name_type!(
    /// The name of a VM; also the host name clients reach it by.
    VmName, "VM", "web01"
);
name_type!(
    /// The name of a network.
    NetworkName, "network", "prod"
);
name_type!(
    /// The name of a node (its certificate is `NAME.nodes.otherix`).
    NodeName, "node", "node1"
);
name_type!(
    /// The name of a load balancer (`lb/NAME` in a broker target).
    LbName, "load balancer", "web-lb"
);
name_type!(
    /// The name of a user.
    UserName, "user", "alice"
);
name_type!(
    /// The name of a grant.
    GrantName, "grant", "contractor"
);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ordinary_names_are_accepted() {
        for name in ["web", "web-1", "a", "0", "9lives", "db-primary-02"] {
            assert_eq!(validate_name(name), Ok(()), "{name}");
        }
    }

    #[test]
    fn sixty_three_characters_is_the_limit() {
        let name = "a".repeat(63);
        assert_eq!(validate_name(&name), Ok(()));
    }

    #[test]
    fn empty_name_is_refused() {
        let err = validate_name("").unwrap_err();
        assert_eq!(err, NameError::Empty);
        assert!(err.to_string().contains("empty"));
    }

    #[test]
    fn long_name_reports_its_length() {
        let err = validate_name(&"a".repeat(64)).unwrap_err();
        assert_eq!(err, NameError::TooLong { len: 64 });
        assert_eq!(err.to_string(), "name is 64 characters long; the limit is 63");
    }

    #[test]
    fn uppercase_is_refused_with_its_position() {
        let err = validate_name("myVm").unwrap_err();
        assert_eq!(
            err,
            NameError::InvalidChar {
                name: "myVm".into(),
                ch: 'V',
                position: 2
            }
        );
        assert_eq!(
            err.to_string(),
            "invalid character 'V' at position 2 in name \"myVm\"; \
             expected lowercase letters a-z, digits 0-9 or '-'"
        );
    }

    #[test]
    fn position_counts_characters_not_bytes() {
        let err = validate_name("é_x").unwrap_err();
        assert_eq!(
            err,
            NameError::InvalidChar {
                name: "é_x".into(),
                ch: 'é',
                position: 0
            }
        );
        let err = validate_name("aé").unwrap_err();
        assert_eq!(
            err,
            NameError::InvalidChar {
                name: "aé".into(),
                ch: 'é',
                position: 1
            }
        );
    }

    #[test]
    fn dots_and_underscores_are_refused() {
        assert!(matches!(
            validate_name("web.prod"),
            Err(NameError::InvalidChar {
                ch: '.',
                position: 3,
                ..
            })
        ));
        assert!(matches!(
            validate_name("web_prod"),
            Err(NameError::InvalidChar {
                ch: '_',
                position: 3,
                ..
            })
        ));
    }

    #[test]
    fn leading_dash_is_refused() {
        let err = validate_name("-web").unwrap_err();
        assert_eq!(err, NameError::BadStart { name: "-web".into() });
        assert!(err
            .to_string()
            .contains("must start with a lowercase letter or digit"));
    }

    #[test]
    fn trailing_dash_is_refused() {
        let err = validate_name("web-").unwrap_err();
        assert_eq!(err, NameError::BadEnd { name: "web-".into() });
        assert!(err
            .to_string()
            .contains("must end with a lowercase letter or digit"));
    }

    #[test]
    fn single_dash_is_reported_as_bad_start() {
        assert_eq!(validate_name("-"), Err(NameError::BadStart { name: "-".into() }));
    }

    #[test]
    fn a_typed_name_is_made_only_from_a_valid_one_and_says_its_kind() {
        let vm = VmName::new("web01").unwrap();
        assert_eq!(vm, "web01");
        assert_eq!(vm.to_string(), "web01");
        assert_eq!(format!("{vm:?}"), "\"web01\"");
        let err = VmName::new("Web01").unwrap_err();
        assert_eq!(err.kind, "VM");
        assert!(
            err.to_string()
                .starts_with("invalid VM name: invalid character 'W'"),
            "{err}"
        );
        let err = "-x".parse::<NodeName>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid node name: name \"-x\" must start with a lowercase letter or digit, not '-'"
        );
    }

    #[test]
    fn a_typed_name_reads_and_writes_as_a_json_string_and_refuses_bad_ones() {
        let vm: VmName = serde_json::from_str("\"db-1\"").unwrap();
        assert_eq!(serde_json::to_string(&vm).unwrap(), "\"db-1\"");
        let err = serde_json::from_str::<NetworkName>("\"prod_net\"").unwrap_err();
        assert!(err.to_string().contains("invalid network name"), "{err}");
        assert!(serde_json::from_str::<LbName>("\"\"").is_err());
        assert!(serde_json::from_str::<UserName>("7").is_err());
    }

    proptest! {
        #[test]
        fn generated_dns_labels_are_accepted(name in "[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?") {
            prop_assert_eq!(validate_name(&name), Ok(()));
        }

        #[test]
        fn arbitrary_input_never_panics_and_accepts_only_dns_labels(name in ".{0,80}") {
            let ok = validate_name(&name).is_ok();
            let expected = !name.is_empty()
                && name.len() <= 63
                && name.chars().all(is_name_char)
                && !name.starts_with('-')
                && !name.ends_with('-');
            prop_assert_eq!(ok, expected);
        }
    }
}
