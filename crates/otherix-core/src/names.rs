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
