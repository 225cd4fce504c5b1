//! Label keys, values and `key=value` / `key-` edits, with Kubernetes' rules.
//!
//! We reuse Kubernetes' label syntax so users can carry their habits (and
//! selectors) over unchanged; being exactly as strict keeps labels portable
//! to anything else that speaks it.

use std::collections::BTreeMap;
use std::fmt;

use thiserror::Error;

/// Labels attached to an object: sorted so listings and serialized forms are
/// stable.
pub type Labels = BTreeMap<String, String>;

/// Longest optional key prefix (a DNS subdomain).
pub const MAX_PREFIX_LEN: usize = 253;
/// Longest key name part and longest value.
pub const MAX_NAME_LEN: usize = 63;

const NAME_CHARSET: &str = "letters, digits, '-', '_' or '.'";
const PREFIX_CHARSET: &str = "lowercase letters, digits, '-' or '.'";

/// Why a label key, value or edit was refused. The caller supplied it.
///
/// Positions are 0-based character indexes into the key or value named in the
/// message (not into a larger string the key came from).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum LabelError {
    /// The key has no characters.
    EmptyKey,
    /// The key starts with `/`, so its prefix is empty.
    EmptyKeyPrefix {
        /// The refused key.
        key: String,
    },
    /// The key ends with `/`, so its name part is empty.
    EmptyKeyName {
        /// The refused key.
        key: String,
    },
    /// The prefix before `/` is longer than a DNS subdomain may be.
    KeyPrefixTooLong {
        /// Length of the prefix, in characters.
        len: usize,
    },
    /// The name part of the key is longer than 63 characters.
    KeyNameTooLong {
        /// Length of the name part, in characters.
        len: usize,
    },
    /// The prefix holds a character a DNS subdomain may not.
    InvalidKeyPrefixChar {
        /// The refused key.
        key: String,
        /// The offending character.
        ch: char,
        /// Its position in `key`.
        position: usize,
    },
    /// A dot-separated part of the prefix starts or ends with `-` or `.`.
    KeyPrefixBadBoundary {
        /// The refused key.
        key: String,
        /// The offending character.
        ch: char,
        /// Its position in `key`.
        position: usize,
    },
    /// The name part holds a character outside `[A-Za-z0-9._-]`.
    InvalidKeyNameChar {
        /// The refused key.
        key: String,
        /// The offending character.
        ch: char,
        /// Its position in `key`.
        position: usize,
    },
    /// The name part starts or ends with `-`, `_` or `.`.
    KeyNameBadBoundary {
        /// The refused key.
        key: String,
        /// The offending character.
        ch: char,
        /// Its position in `key`.
        position: usize,
    },
    /// The value is longer than 63 characters.
    ValueTooLong {
        /// Length of the value, in characters.
        len: usize,
    },
    /// The value holds a character outside `[A-Za-z0-9._-]`.
    InvalidValueChar {
        /// The refused value.
        value: String,
        /// The offending character.
        ch: char,
        /// Its position in `value`.
        position: usize,
    },
    /// The value starts or ends with `-`, `_` or `.`.
    ValueBadBoundary {
        /// The refused value.
        value: String,
        /// The offending character.
        ch: char,
        /// Its position in `value`.
        position: usize,
    },
    /// A `key=value` label without `=`.
    MissingEquals {
        /// The refused input.
        input: String,
    },
    /// A label edit that is neither `key=value` nor `key-`.
    MissingChange {
        /// The refused input.
        input: String,
    },
}

impl LabelError {
    /// Where in the key or value the problem is, when it is at one character.
    pub fn position(&self) -> Option<usize> {
        match self {
            Self::EmptyKeyPrefix { .. } => Some(0),
            Self::EmptyKeyName { key } => Some(key.chars().count()),
            Self::InvalidKeyPrefixChar { position, .. }
            | Self::KeyPrefixBadBoundary { position, .. }
            | Self::InvalidKeyNameChar { position, .. }
            | Self::KeyNameBadBoundary { position, .. }
            | Self::InvalidValueChar { position, .. }
            | Self::ValueBadBoundary { position, .. } => Some(*position),
            Self::EmptyKey
            | Self::KeyPrefixTooLong { .. }
            | Self::KeyNameTooLong { .. }
            | Self::ValueTooLong { .. }
            | Self::MissingEquals { .. }
            | Self::MissingChange { .. } => None,
        }
    }

    /// Writes the message, with or without the position: a caller that
    /// reports its own position in a larger input (the selector parser) would
    /// otherwise show two positions counted from different starts.
    fn write(&self, f: &mut fmt::Formatter<'_>, located: bool) -> fmt::Result {
        let at = |position: &usize| {
            if located {
                format!(" at position {position}")
            } else {
                String::new()
            }
        };
        match self {
            Self::EmptyKey => {
                write!(
                    f,
                    "label key is empty; expected [prefix/]name, e.g. app or example.com/app"
                )
            }
            Self::EmptyKeyPrefix { key } => write!(
                f,
                "label key {key:?} has an empty prefix before '/'; \
                 expected a DNS subdomain such as example.com"
            ),
            Self::EmptyKeyName { key } => write!(
                f,
                "label key {key:?} has an empty name after '/'; expected 1 to 63 characters"
            ),
            Self::KeyPrefixTooLong { len } => write!(
                f,
                "label key prefix is {len} characters long; the limit is {MAX_PREFIX_LEN}"
            ),
            Self::KeyNameTooLong { len } => write!(
                f,
                "label key name is {len} characters long; the limit is {MAX_NAME_LEN}"
            ),
            Self::InvalidKeyPrefixChar { key, ch, position } => write!(
                f,
                "invalid character {ch:?}{} in the prefix of label key {key:?}; \
                 expected {PREFIX_CHARSET}",
                at(position)
            ),
            Self::KeyPrefixBadBoundary { key, ch, position } => write!(
                f,
                "label key {key:?} has {ch:?}{} in its prefix; each dot-separated part \
                 must start and end with a lowercase letter or digit",
                at(position)
            ),
            Self::InvalidKeyNameChar { key, ch, position } => write!(
                f,
                "invalid character {ch:?}{} in label key {key:?}; expected {NAME_CHARSET}",
                at(position)
            ),
            Self::KeyNameBadBoundary { key, ch, position } => write!(
                f,
                "label key {key:?} has {ch:?}{}; a key name must start and end \
                 with a letter or digit",
                at(position)
            ),
            Self::ValueTooLong { len } => write!(
                f,
                "label value is {len} characters long; the limit is {MAX_NAME_LEN}"
            ),
            Self::InvalidValueChar { value, ch, position } => write!(
                f,
                "invalid character {ch:?}{} in label value {value:?}; expected {NAME_CHARSET}",
                at(position)
            ),
            Self::ValueBadBoundary { value, ch, position } => write!(
                f,
                "label value {value:?} has {ch:?}{}; a value must start and end \
                 with a letter or digit",
                at(position)
            ),
            Self::MissingEquals { input } => {
                write!(f, "label {input:?} has no '='; expected key=value")
            }
            Self::MissingChange { input } => write!(
                f,
                "label change {input:?} has neither '=' nor a trailing '-'; \
                 expected key=value to set or key- to remove"
            ),
        }
    }
}

impl fmt::Display for LabelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f, true)
    }
}

/// A [`LabelError`] displayed without its position, for callers that report
/// their own.
pub(crate) struct Unlocated<'a>(pub(crate) &'a LabelError);

impl fmt::Display for Unlocated<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.write(f, false)
    }
}

/// Checks a label key: `[prefix/]name`, where the optional prefix is a DNS
/// subdomain of at most 253 characters and the name is 1 to 63 characters of
/// `[A-Za-z0-9._-]` starting and ending with a letter or digit.
pub fn validate_label_key(key: &str) -> Result<(), LabelError> {
    if key.is_empty() {
        return Err(LabelError::EmptyKey);
    }
    let (prefix, name, name_offset) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name, prefix.chars().count() + 1),
        None => (None, key, 0),
    };
    if let Some(prefix) = prefix {
        validate_prefix(key, prefix)?;
    }
    if name.is_empty() {
        return Err(LabelError::EmptyKeyName { key: key.to_owned() });
    }
    let len = name.chars().count();
    if len > MAX_NAME_LEN {
        return Err(LabelError::KeyNameTooLong { len });
    }
    check_name_chars(name).map_err(|problem| match problem {
        Problem::Invalid { ch, position } => LabelError::InvalidKeyNameChar {
            key: key.to_owned(),
            ch,
            position: name_offset + position,
        },
        Problem::Boundary { ch, position } => LabelError::KeyNameBadBoundary {
            key: key.to_owned(),
            ch,
            position: name_offset + position,
        },
    })
}

/// Checks a label value: empty, or 1 to 63 characters of `[A-Za-z0-9._-]`
/// starting and ending with a letter or digit.
pub fn validate_label_value(value: &str) -> Result<(), LabelError> {
    let len = value.chars().count();
    if len > MAX_NAME_LEN {
        return Err(LabelError::ValueTooLong { len });
    }
    check_name_chars(value).map_err(|problem| match problem {
        Problem::Invalid { ch, position } => LabelError::InvalidValueChar {
            value: value.to_owned(),
            ch,
            position,
        },
        Problem::Boundary { ch, position } => LabelError::ValueBadBoundary {
            value: value.to_owned(),
            ch,
            position,
        },
    })
}

/// Checks every key and value of a label set, e.g. one received over the API.
pub fn validate_labels(labels: &Labels) -> Result<(), LabelError> {
    for (key, value) in labels {
        validate_label_key(key)?;
        validate_label_value(value)?;
    }
    Ok(())
}

/// Parses `key=value` into a validated pair. The first `=` separates key and
/// value; the value may be empty.
pub fn parse_label(s: &str) -> Result<(String, String), LabelError> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| LabelError::MissingEquals { input: s.to_owned() })?;
    validate_label_key(key)?;
    validate_label_value(value)?;
    Ok((key.to_owned(), value.to_owned()))
}

/// One edit to a label set, as given to `kubectl label`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LabelChange {
    /// Set `key` to `value`, replacing any previous value.
    Set(String, String),
    /// Remove `key` if present.
    Remove(String),
}

impl LabelChange {
    /// Applies the edit. Removing an absent key is not an error, so replaying
    /// an edit is harmless.
    pub fn apply(&self, labels: &mut Labels) {
        match self {
            Self::Set(key, value) => {
                labels.insert(key.clone(), value.clone());
            }
            Self::Remove(key) => {
                labels.remove(key);
            }
        }
    }
}

/// Parses a label edit: `key=value` sets, `key-` removes.
///
/// An `=` wins over a trailing `-`, so `tier=db-` is a set whose value is then
/// refused for ending in `-`, rather than a confusing removal.
pub fn parse_label_change(s: &str) -> Result<LabelChange, LabelError> {
    if s.contains('=') {
        let (key, value) = parse_label(s)?;
        return Ok(LabelChange::Set(key, value));
    }
    match s.strip_suffix('-') {
        Some(key) => {
            validate_label_key(key)?;
            Ok(LabelChange::Remove(key.to_owned()))
        }
        None => Err(LabelError::MissingChange { input: s.to_owned() }),
    }
}

/// What is wrong with one character of a name part or value; positions are
/// relative to the checked string and shifted by the caller.
enum Problem {
    Invalid { ch: char, position: usize },
    Boundary { ch: char, position: usize },
}

/// Checks `[A-Za-z0-9._-]*`, beginning and ending alphanumeric if non-empty.
/// Reports the leftmost problem.
fn check_name_chars(s: &str) -> Result<(), Problem> {
    let mut last = None;
    for (position, ch) in s.chars().enumerate() {
        if !(ch.is_ascii_alphanumeric() || matches!(ch, '-' | '_' | '.')) {
            return Err(Problem::Invalid { ch, position });
        }
        if position == 0 && !ch.is_ascii_alphanumeric() {
            return Err(Problem::Boundary { ch, position });
        }
        last = Some((position, ch));
    }
    match last {
        Some((position, ch)) if !ch.is_ascii_alphanumeric() => Err(Problem::Boundary { ch, position }),
        _ => Ok(()),
    }
}

/// Checks a key prefix as an RFC 1123 DNS subdomain: dot-separated parts of
/// lowercase letters, digits and `-`, each starting and ending alphanumeric.
fn validate_prefix(key: &str, prefix: &str) -> Result<(), LabelError> {
    if prefix.is_empty() {
        return Err(LabelError::EmptyKeyPrefix { key: key.to_owned() });
    }
    let len = prefix.chars().count();
    if len > MAX_PREFIX_LEN {
        return Err(LabelError::KeyPrefixTooLong { len });
    }
    let boundary = |ch, position| LabelError::KeyPrefixBadBoundary {
        key: key.to_owned(),
        ch,
        position,
    };
    let mut prev: Option<char> = None;
    for (position, ch) in prefix.chars().enumerate() {
        if !(ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '-' || ch == '.') {
            return Err(LabelError::InvalidKeyPrefixChar {
                key: key.to_owned(),
                ch,
                position,
            });
        }
        let starts_part = matches!(prev, None | Some('.'));
        if starts_part && (ch == '-' || ch == '.') {
            return Err(boundary(ch, position));
        }
        // A '-' just before a '.' ends a part; point at the '-'. `position`
        // is at least 1 here because `prev` is set, so the subtraction holds.
        if ch == '.' && prev == Some('-') {
            return Err(boundary('-', position - 1));
        }
        prev = Some(ch);
    }
    match prev {
        Some(ch @ ('-' | '.')) => Err(boundary(ch, len - 1)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn plain_and_prefixed_keys_are_accepted() {
        for key in [
            "app",
            "App.Kubernetes_io-x",
            "a",
            "example.com/app",
            "otherix.io/tier",
            "a-b.c-d/x",
            "1/2",
        ] {
            assert_eq!(validate_label_key(key), Ok(()), "{key}");
        }
    }

    #[test]
    fn empty_key_is_refused() {
        assert_eq!(validate_label_key(""), Err(LabelError::EmptyKey));
    }

    #[test]
    fn key_name_of_64_characters_is_refused_with_its_length() {
        assert_eq!(validate_label_key(&"a".repeat(63)), Ok(()));
        let err = validate_label_key(&"a".repeat(64)).unwrap_err();
        assert_eq!(err, LabelError::KeyNameTooLong { len: 64 });
        assert_eq!(
            err.to_string(),
            "label key name is 64 characters long; the limit is 63"
        );
    }

    #[test]
    fn key_prefix_of_254_characters_is_refused() {
        let ok = format!("{}/app", "a".repeat(253));
        assert_eq!(validate_label_key(&ok), Ok(()));
        let long = format!("{}/app", "a".repeat(254));
        assert_eq!(
            validate_label_key(&long),
            Err(LabelError::KeyPrefixTooLong { len: 254 })
        );
    }

    #[test]
    fn empty_prefix_or_name_around_slash_is_refused() {
        assert_eq!(
            validate_label_key("/app"),
            Err(LabelError::EmptyKeyPrefix { key: "/app".into() })
        );
        let err = validate_label_key("example.com/").unwrap_err();
        assert_eq!(
            err,
            LabelError::EmptyKeyName {
                key: "example.com/".into()
            }
        );
        assert_eq!(err.position(), Some(12));
    }

    #[test]
    fn second_slash_is_an_invalid_name_character() {
        let err = validate_label_key("a/b/c").unwrap_err();
        assert_eq!(
            err,
            LabelError::InvalidKeyNameChar {
                key: "a/b/c".into(),
                ch: '/',
                position: 3
            }
        );
    }

    #[test]
    fn invalid_key_character_reports_position_in_whole_key() {
        let err = validate_label_key("example.com/ap p").unwrap_err();
        assert_eq!(
            err,
            LabelError::InvalidKeyNameChar {
                key: "example.com/ap p".into(),
                ch: ' ',
                position: 14
            }
        );
        assert_eq!(
            err.to_string(),
            "invalid character ' ' at position 14 in label key \"example.com/ap p\"; \
             expected letters, digits, '-', '_' or '.'"
        );
    }

    #[test]
    fn uppercase_prefix_is_refused() {
        let err = validate_label_key("Example.com/app").unwrap_err();
        assert_eq!(
            err,
            LabelError::InvalidKeyPrefixChar {
                key: "Example.com/app".into(),
                ch: 'E',
                position: 0
            }
        );
        assert!(err
            .to_string()
            .contains("expected lowercase letters, digits, '-' or '.'"));
    }

    #[test]
    fn prefix_parts_must_start_and_end_alphanumeric() {
        let cases = [
            ("-a.com/x", '-', 0),
            (".a.com/x", '.', 0),
            ("a..com/x", '.', 2),
            ("a-.com/x", '-', 1),
            ("a.-com/x", '-', 2),
            ("a.com-/x", '-', 5),
            ("a.com./x", '.', 5),
        ];
        for (key, ch, position) in cases {
            assert_eq!(
                validate_label_key(key),
                Err(LabelError::KeyPrefixBadBoundary {
                    key: key.into(),
                    ch,
                    position
                }),
                "{key}"
            );
        }
    }

    #[test]
    fn key_name_must_start_and_end_alphanumeric() {
        assert_eq!(
            validate_label_key("_app"),
            Err(LabelError::KeyNameBadBoundary {
                key: "_app".into(),
                ch: '_',
                position: 0
            })
        );
        let err = validate_label_key("x.io/app.").unwrap_err();
        assert_eq!(
            err,
            LabelError::KeyNameBadBoundary {
                key: "x.io/app.".into(),
                ch: '.',
                position: 8
            }
        );
        assert!(err
            .to_string()
            .contains("must start and end with a letter or digit"));
    }

    #[test]
    fn empty_value_is_accepted() {
        assert_eq!(validate_label_value(""), Ok(()));
    }

    #[test]
    fn ordinary_values_are_accepted() {
        for value in ["web", "Prod_1", "v1.2.3", "a", "a-b_c.d", &"x".repeat(63)] {
            assert_eq!(validate_label_value(value), Ok(()), "{value}");
        }
    }

    #[test]
    fn value_of_64_characters_is_refused() {
        let err = validate_label_value(&"v".repeat(64)).unwrap_err();
        assert_eq!(err, LabelError::ValueTooLong { len: 64 });
        assert_eq!(
            err.to_string(),
            "label value is 64 characters long; the limit is 63"
        );
    }

    #[test]
    fn invalid_value_character_is_reported_with_position() {
        let err = validate_label_value("we b").unwrap_err();
        assert_eq!(
            err,
            LabelError::InvalidValueChar {
                value: "we b".into(),
                ch: ' ',
                position: 2
            }
        );
        assert_eq!(
            err.to_string(),
            "invalid character ' ' at position 2 in label value \"we b\"; \
             expected letters, digits, '-', '_' or '.'"
        );
    }

    #[test]
    fn value_must_start_and_end_alphanumeric() {
        assert_eq!(
            validate_label_value("-web"),
            Err(LabelError::ValueBadBoundary {
                value: "-web".into(),
                ch: '-',
                position: 0
            })
        );
        assert_eq!(
            validate_label_value("web."),
            Err(LabelError::ValueBadBoundary {
                value: "web.".into(),
                ch: '.',
                position: 3
            })
        );
    }

    #[test]
    fn label_parses_into_key_and_value() {
        assert_eq!(parse_label("app=web"), Ok(("app".into(), "web".into())));
        assert_eq!(parse_label("x.io/tier="), Ok(("x.io/tier".into(), String::new())));
    }

    #[test]
    fn label_without_equals_is_refused() {
        let err = parse_label("app").unwrap_err();
        assert_eq!(err, LabelError::MissingEquals { input: "app".into() });
        assert_eq!(err.to_string(), "label \"app\" has no '='; expected key=value");
    }

    #[test]
    fn second_equals_belongs_to_the_value_and_is_refused() {
        assert_eq!(
            parse_label("a=b=c"),
            Err(LabelError::InvalidValueChar {
                value: "b=c".into(),
                ch: '=',
                position: 1
            })
        );
    }

    #[test]
    fn label_with_bad_key_reports_the_key() {
        assert_eq!(parse_label("=web"), Err(LabelError::EmptyKey));
    }

    #[test]
    fn label_change_with_equals_sets() {
        assert_eq!(
            parse_label_change("app=web"),
            Ok(LabelChange::Set("app".into(), "web".into()))
        );
    }

    #[test]
    fn label_change_with_trailing_dash_removes() {
        assert_eq!(
            parse_label_change("x.io/app-"),
            Ok(LabelChange::Remove("x.io/app".into()))
        );
    }

    #[test]
    fn equals_wins_over_trailing_dash() {
        assert_eq!(
            parse_label_change("tier=db-"),
            Err(LabelError::ValueBadBoundary {
                value: "db-".into(),
                ch: '-',
                position: 2
            })
        );
    }

    #[test]
    fn label_change_without_operation_is_refused() {
        let err = parse_label_change("app").unwrap_err();
        assert_eq!(err, LabelError::MissingChange { input: "app".into() });
        assert!(err
            .to_string()
            .contains("expected key=value to set or key- to remove"));
    }

    #[test]
    fn lone_dash_is_an_empty_key() {
        assert_eq!(parse_label_change("-"), Err(LabelError::EmptyKey));
    }

    #[test]
    fn label_changes_apply_in_order() {
        let mut labels = Labels::new();
        for change in ["app=web", "tier=db", "app=api", "tier-", "gone-"] {
            parse_label_change(change).unwrap().apply(&mut labels);
        }
        assert_eq!(labels, Labels::from([("app".into(), "api".into())]));
    }

    #[test]
    fn validate_labels_checks_keys_and_values() {
        let good = Labels::from([("app".into(), "web".into()), ("x.io/t".into(), String::new())]);
        assert_eq!(validate_labels(&good), Ok(()));
        let bad = Labels::from([("app".into(), "we b".into())]);
        assert!(matches!(
            validate_labels(&bad),
            Err(LabelError::InvalidValueChar { .. })
        ));
    }

    #[test]
    fn unlocated_message_omits_position() {
        let err = validate_label_value("we b").unwrap_err();
        assert_eq!(
            Unlocated(&err).to_string(),
            "invalid character ' ' in label value \"we b\"; \
             expected letters, digits, '-', '_' or '.'"
        );
    }

    proptest! {
        #[test]
        fn generated_labels_parse_back(
            key in "([a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?\\.){0,2}[a-z]{1,5}/[A-Za-z0-9]([A-Za-z0-9._-]{0,10}[A-Za-z0-9])?",
            value in "([A-Za-z0-9]([A-Za-z0-9._-]{0,10}[A-Za-z0-9])?)?",
        ) {
            let text = format!("{key}={value}");
            prop_assert_eq!(parse_label(&text), Ok((key.clone(), value.clone())));
            prop_assert_eq!(parse_label_change(&format!("{key}-")), Ok(LabelChange::Remove(key)));
        }

        #[test]
        fn arbitrary_input_never_panics(s in ".{0,80}") {
            let _ = validate_label_key(&s);
            let _ = validate_label_value(&s);
            let _ = parse_label(&s);
            let _ = parse_label_change(&s);
        }

        #[test]
        fn reported_position_points_at_the_reported_character(s in "[a-zA-Z0-9./_ $-]{0,20}") {
            for result in [validate_label_key(&s), validate_label_value(&s)] {
                if let Err(
                    LabelError::InvalidKeyNameChar { ch, position, .. }
                    | LabelError::KeyNameBadBoundary { ch, position, .. }
                    | LabelError::InvalidKeyPrefixChar { ch, position, .. }
                    | LabelError::KeyPrefixBadBoundary { ch, position, .. }
                    | LabelError::InvalidValueChar { ch, position, .. }
                    | LabelError::ValueBadBoundary { ch, position, .. },
                ) = result
                {
                    prop_assert_eq!(s.chars().nth(position), Some(ch));
                }
            }
        }
    }
}
