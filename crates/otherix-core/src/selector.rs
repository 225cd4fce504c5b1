//! Label selectors (`app=web,env in (prod,staging),!legacy`) with Kubernetes'
//! grammar and matching rules.
//!
//! Selectors choose the VMs an access rule or load balancer applies to. They
//! arrive from users and over the API, so the parser is total (never panics)
//! and its errors point at the offending character.
//!
//! Kubernetes' semantics fail open for authorization: `!key`, `key!=v`,
//! `key notin (...)` and the empty selector also match a VM that has no
//! labels at all, so a rule written as "everything not labelled prod" admits
//! every VM created a second later without labels. An access rule must
//! therefore [`Selector::require_label`]: name at least one label the VM
//! must carry. Load-balancer pools keep the plain semantics (a pool is not
//! an authorization boundary: a user's rules still filter its backends).

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::labels::{validate_label_key, validate_label_value, LabelError, Labels, Unlocated};

/// A conjunction of [`Requirement`]s; the empty selector matches everything.
///
/// Serialized as its canonical text, so stored selectors read like the ones
/// users type.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Selector {
    requirements: Vec<Requirement>,
}

/// One condition on one label key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Requirement {
    /// `key=value` (or `key==value`): the key is present with this value.
    Equals {
        /// Label key.
        key: String,
        /// Required value.
        value: String,
    },
    /// `key!=value`: the key is absent or has another value.
    NotEquals {
        /// Label key.
        key: String,
        /// Refused value.
        value: String,
    },
    /// `key in (a,b)`: the key is present with one of these values.
    In {
        /// Label key.
        key: String,
        /// Accepted values.
        values: BTreeSet<String>,
    },
    /// `key notin (a,b)`: the key is absent or has none of these values.
    NotIn {
        /// Label key.
        key: String,
        /// Refused values.
        values: BTreeSet<String>,
    },
    /// `key`: the key is present, with any value.
    Exists {
        /// Label key.
        key: String,
    },
    /// `!key`: the key is absent.
    DoesNotExist {
        /// Label key.
        key: String,
    },
}

/// A selector the caller wrote could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid selector {input:?} at position {position}: {message}")]
#[non_exhaustive]
pub struct SelectorError {
    /// The refused selector text.
    pub input: String,
    /// 0-based character index of the offending character in `input`; equal
    /// to the input's length when the input ended too early.
    pub position: usize,
    /// What is wrong and what was expected there.
    pub message: String,
}

impl Selector {
    /// Whether `labels` satisfies every requirement, with Kubernetes'
    /// semantics: `!=` and `notin` also match when the key is absent.
    pub fn matches(&self, labels: &Labels) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }

    /// Whether this selector has no requirements, and so matches everything.
    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    /// The requirements, in the order they were written.
    pub fn requirements(&self) -> &[Requirement] {
        &self.requirements
    }

    /// Whether some requirement needs a label to be present (`k=v`,
    /// `k in (...)`, `k`): only such a selector can never match a VM with
    /// no labels, nor one that merely lacks the labels it names.
    pub fn requires_a_label(&self) -> bool {
        self.requirements.iter().any(Requirement::requires_the_label)
    }

    /// `Ok` when the selector [requires a label](Self::requires_a_label),
    /// as an access rule's must: otherwise it would admit any VM created
    /// without labels.
    pub fn require_label(&self) -> Result<(), RequiresNoLabel> {
        if self.requires_a_label() {
            Ok(())
        } else {
            Err(RequiresNoLabel {
                selector: self.to_string(),
            })
        }
    }
}

/// A selector that requires no label was offered where one must (an access
/// rule): the caller's mistake.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "selector {} requires no label, so it would admit any VM created without labels",
    if selector.is_empty() { "\"\" (empty)".to_owned() } else { format!("`{selector}`") }
)]
#[non_exhaustive]
pub struct RequiresNoLabel {
    /// The refused selector, in canonical form.
    pub selector: String,
}

impl Requirement {
    /// The label key this requirement is about.
    pub fn key(&self) -> &str {
        match self {
            Self::Equals { key, .. }
            | Self::NotEquals { key, .. }
            | Self::In { key, .. }
            | Self::NotIn { key, .. }
            | Self::Exists { key }
            | Self::DoesNotExist { key } => key,
        }
    }

    /// Whether this requirement holds only when its key is present
    /// (`=`, `==`, `in`, exists), unlike `!=`, `notin` and `!key`.
    pub fn requires_the_label(&self) -> bool {
        matches!(self, Self::Equals { .. } | Self::In { .. } | Self::Exists { .. })
    }

    /// Whether `labels` satisfies this requirement.
    pub fn matches(&self, labels: &Labels) -> bool {
        let found = labels.get(self.key());
        match self {
            Self::Equals { value, .. } => found == Some(value),
            Self::NotEquals { value, .. } => found != Some(value),
            Self::In { values, .. } => found.is_some_and(|v| values.contains(v)),
            Self::NotIn { values, .. } => !found.is_some_and(|v| values.contains(v)),
            Self::Exists { .. } => found.is_some(),
            Self::DoesNotExist { .. } => found.is_none(),
        }
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let write_set = |f: &mut fmt::Formatter<'_>, values: &BTreeSet<String>| {
            f.write_str("(")?;
            for (i, value) in values.iter().enumerate() {
                if i > 0 {
                    f.write_str(",")?;
                }
                f.write_str(value)?;
            }
            f.write_str(")")
        };
        match self {
            Self::Equals { key, value } => write!(f, "{key}={value}"),
            Self::NotEquals { key, value } => write!(f, "{key}!={value}"),
            Self::In { key, values } => {
                write!(f, "{key} in ")?;
                write_set(f, values)
            }
            Self::NotIn { key, values } => {
                write!(f, "{key} notin ")?;
                write_set(f, values)
            }
            Self::Exists { key } => f.write_str(key),
            Self::DoesNotExist { key } => write!(f, "!{key}"),
        }
    }
}

/// The canonical form: requirements in their original order, joined by `,`,
/// value sets sorted. It parses back to an equal selector.
impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, requirement) in self.requirements.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{requirement}")?;
        }
        Ok(())
    }
}

impl FromStr for Selector {
    type Err = SelectorError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Parser::new(s).parse()
    }
}

impl TryFrom<String> for Selector {
    type Error = SelectorError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Selector> for String {
    fn from(selector: Selector) -> Self {
        selector.to_string()
    }
}

/// A lexical token. Identifiers are maximal runs of characters that are
/// neither whitespace nor punctuation; checking them against the label rules
/// afterwards gives errors that name the exact bad character.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Ident(String),
    Eq,
    DoubleEq,
    NotEq,
    Bang,
    Comma,
    LParen,
    RParen,
    End,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ident(s) => write!(f, "'{s}'"),
            Self::Eq => f.write_str("'='"),
            Self::DoubleEq => f.write_str("'=='"),
            Self::NotEq => f.write_str("'!='"),
            Self::Bang => f.write_str("'!'"),
            Self::Comma => f.write_str("','"),
            Self::LParen => f.write_str("'('"),
            Self::RParen => f.write_str("')'"),
            Self::End => f.write_str("end of input"),
        }
    }
}

#[derive(Debug, Clone)]
struct Token {
    kind: Kind,
    /// Character index of the token's first character.
    start: usize,
}

/// Kubernetes treats exactly these as whitespace between tokens.
fn is_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\r' | '\n')
}

fn is_punct(c: char) -> bool {
    matches!(c, '=' | '!' | ',' | '(' | ')')
}

fn lex(input: &str) -> Vec<Token> {
    let mut tokens = Vec::new();
    let mut chars = input.chars().enumerate().peekable();
    while let Some((start, c)) = chars.next() {
        let kind = match c {
            c if is_space(c) => continue,
            '=' | '!' => {
                let doubled = chars.next_if(|&(_, next)| next == '=').is_some();
                match (c, doubled) {
                    ('=', false) => Kind::Eq,
                    ('=', true) => Kind::DoubleEq,
                    (_, false) => Kind::Bang,
                    (_, true) => Kind::NotEq,
                }
            }
            ',' => Kind::Comma,
            '(' => Kind::LParen,
            ')' => Kind::RParen,
            _ => {
                let mut ident = String::from(c);
                while let Some((_, next)) = chars.next_if(|&(_, n)| !is_space(n) && !is_punct(n)) {
                    ident.push(next);
                }
                Kind::Ident(ident)
            }
        };
        tokens.push(Token { kind, start });
    }
    tokens
}

struct Parser<'a> {
    input: &'a str,
    tokens: Vec<Token>,
    next: usize,
    /// Character count of the input: where `End` is, for errors about input
    /// that stopped too early.
    end: usize,
}

impl<'a> Parser<'a> {
    fn new(input: &'a str) -> Self {
        Self {
            input,
            tokens: lex(input),
            next: 0,
            end: input.chars().count(),
        }
    }

    /// The next token without consuming it; `End` once the tokens run out,
    /// so the grammar code never indexes past the end.
    fn peek(&self) -> Token {
        self.tokens.get(self.next).cloned().unwrap_or(Token {
            kind: Kind::End,
            start: self.end,
        })
    }

    fn bump(&mut self) -> Token {
        let token = self.peek();
        if self.next < self.tokens.len() {
            self.next += 1;
        }
        token
    }

    fn error(&self, position: usize, message: String) -> SelectorError {
        SelectorError {
            input: self.input.to_owned(),
            position,
            message,
        }
    }

    fn unexpected(&self, token: &Token, expected: &str) -> SelectorError {
        self.error(
            token.start,
            format!("unexpected {}, expected {expected}", token.kind),
        )
    }

    fn label_error(&self, start: usize, err: &LabelError) -> SelectorError {
        self.error(start + err.position().unwrap_or(0), Unlocated(err).to_string())
    }

    fn parse(mut self) -> Result<Selector, SelectorError> {
        let mut requirements = Vec::new();
        if self.peek().kind == Kind::End {
            return Ok(Selector { requirements });
        }
        loop {
            requirements.push(self.requirement()?);
            let token = self.bump();
            match token.kind {
                Kind::Comma => continue,
                Kind::End => return Ok(Selector { requirements }),
                _ => return Err(self.unexpected(&token, "',' or end of input")),
            }
        }
    }

    fn requirement(&mut self) -> Result<Requirement, SelectorError> {
        let token = self.bump();
        let key = match token.kind {
            Kind::Bang => {
                let key = self.key("a label key after '!'")?;
                return Ok(Requirement::DoesNotExist { key });
            }
            Kind::Ident(key) => {
                validate_label_key(&key).map_err(|e| self.label_error(token.start, &e))?;
                key
            }
            _ => return Err(self.unexpected(&token, "a label key or '!'")),
        };
        let op = self.peek();
        // `in` and `notin` are keywords only after a key, so keys named
        // "in" or "notin" still work (Kubernetes would refuse them).
        match op.kind {
            Kind::Comma | Kind::End => Ok(Requirement::Exists { key }),
            Kind::Eq | Kind::DoubleEq => {
                self.bump();
                Ok(Requirement::Equals {
                    key,
                    value: self.value()?,
                })
            }
            Kind::NotEq => {
                self.bump();
                Ok(Requirement::NotEquals {
                    key,
                    value: self.value()?,
                })
            }
            Kind::Ident(word) if word == "in" => {
                self.bump();
                Ok(Requirement::In {
                    key,
                    values: self.set("in")?,
                })
            }
            Kind::Ident(word) if word == "notin" => {
                self.bump();
                Ok(Requirement::NotIn {
                    key,
                    values: self.set("notin")?,
                })
            }
            _ => Err(self.unexpected(
                &op,
                "an operator ('=', '==', '!=', 'in', 'notin'), ',' or end of input",
            )),
        }
    }

    fn key(&mut self, expected: &str) -> Result<String, SelectorError> {
        let token = self.bump();
        match token.kind {
            Kind::Ident(key) => {
                validate_label_key(&key).map_err(|e| self.label_error(token.start, &e))?;
                Ok(key)
            }
            _ => Err(self.unexpected(&token, expected)),
        }
    }

    /// The value after `=`, `==` or `!=`; absent means the empty value, as in
    /// Kubernetes (`tier=` selects an empty `tier` label).
    fn value(&mut self) -> Result<String, SelectorError> {
        let token = self.peek();
        match token.kind {
            Kind::Ident(value) => {
                self.bump();
                validate_label_value(&value).map_err(|e| self.label_error(token.start, &e))?;
                Ok(value)
            }
            Kind::Comma | Kind::End => Ok(String::new()),
            _ => Err(self.unexpected(&token, "a label value, ',' or end of input")),
        }
    }

    /// `( v1, v2, ... )`. An empty slot is the empty value, as in Kubernetes:
    /// `()` is `{""}` and `(a,)` is `{"a", ""}`.
    fn set(&mut self, op: &str) -> Result<BTreeSet<String>, SelectorError> {
        let open = self.bump();
        if open.kind != Kind::LParen {
            return Err(self.unexpected(&open, &format!("'(' after '{op}'")));
        }
        let mut values = BTreeSet::new();
        loop {
            let token = self.peek();
            match token.kind {
                Kind::Ident(value) => {
                    self.bump();
                    validate_label_value(&value).map_err(|e| self.label_error(token.start, &e))?;
                    values.insert(value);
                }
                Kind::Comma | Kind::RParen => {
                    values.insert(String::new());
                }
                _ => return Err(self.unexpected(&token, "a label value, ',' or ')'")),
            }
            let token = self.bump();
            match token.kind {
                Kind::Comma => continue,
                Kind::RParen => return Ok(values),
                _ => return Err(self.unexpected(&token, "',' or ')'")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::{btree_map, btree_set, vec};
    use proptest::prelude::*;
    use serde::de::value::{Error as DeError, StrDeserializer};
    use serde::de::IntoDeserializer;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn sel(s: &str) -> Selector {
        s.parse().unwrap()
    }

    fn set(values: &[&str]) -> BTreeSet<String> {
        values.iter().map(|v| (*v).to_owned()).collect()
    }

    fn err(s: &str) -> SelectorError {
        s.parse::<Selector>().unwrap_err()
    }

    #[test]
    fn empty_selector_matches_everything() {
        for s in ["", "   ", "\t\n"] {
            let selector = sel(s);
            assert!(selector.is_empty());
            assert!(selector.matches(&Labels::new()));
            assert!(selector.matches(&labels(&[("app", "web")])));
            assert_eq!(selector.to_string(), "");
        }
    }

    #[test]
    fn only_selectors_naming_a_label_to_carry_require_one() {
        for text in [
            "app=web",
            "env in (prod)",
            "gpu",
            "tier=",
            "k in ()",
            "env!=prod,team=web",
            "!legacy,gpu",
        ] {
            assert!(sel(text).requires_a_label(), "{text}");
            assert_eq!(sel(text).require_label(), Ok(()), "{text}");
        }
        for text in [
            "",
            "env!=prod",
            "env notin (prod)",
            "!legacy",
            "a!=1,b notin (x),!c",
        ] {
            assert!(!sel(text).requires_a_label(), "{text}");
        }
        assert_eq!(
            sel("env!=prod").require_label().unwrap_err().to_string(),
            "selector `env!=prod` requires no label, so it would admit any VM created without labels"
        );
        assert_eq!(
            sel("").require_label().unwrap_err().to_string(),
            "selector \"\" (empty) requires no label, so it would admit any VM created without labels"
        );
    }

    #[test]
    fn every_operator_parses_into_its_requirement() {
        let selector = sel("a=1,b==2,c!=3,d in (x,y),e notin (z),f,!g,h=,i!=");
        assert_eq!(
            selector.requirements(),
            &[
                Requirement::Equals {
                    key: "a".into(),
                    value: "1".into()
                },
                Requirement::Equals {
                    key: "b".into(),
                    value: "2".into()
                },
                Requirement::NotEquals {
                    key: "c".into(),
                    value: "3".into()
                },
                Requirement::In {
                    key: "d".into(),
                    values: set(&["x", "y"])
                },
                Requirement::NotIn {
                    key: "e".into(),
                    values: set(&["z"])
                },
                Requirement::Exists { key: "f".into() },
                Requirement::DoesNotExist { key: "g".into() },
                Requirement::Equals {
                    key: "h".into(),
                    value: String::new()
                },
                Requirement::NotEquals {
                    key: "i".into(),
                    value: String::new()
                },
            ]
        );
    }

    #[test]
    fn whitespace_around_tokens_is_ignored() {
        assert_eq!(
            sel("  app = web ,tier!= canary , env in ( prod , staging ),! legacy "),
            sel("app=web,tier!=canary,env in (prod,staging),!legacy")
        );
    }

    #[test]
    fn display_is_canonical() {
        let selector = sel("app==web, tier != canary,env in (staging, prod,prod),  !legacy");
        assert_eq!(
            selector.to_string(),
            "app=web,tier!=canary,env in (prod,staging),!legacy"
        );
    }

    #[test]
    fn prefixed_keys_are_accepted() {
        let selector = sel("otherix.io/tier=db");
        assert_eq!(
            selector.requirements(),
            &[Requirement::Equals {
                key: "otherix.io/tier".into(),
                value: "db".into()
            }]
        );
    }

    #[test]
    fn in_and_notin_can_be_keys_and_values() {
        let selector = sel("in,notin=in,in in (notin)");
        assert_eq!(
            selector.requirements(),
            &[
                Requirement::Exists { key: "in".into() },
                Requirement::Equals {
                    key: "notin".into(),
                    value: "in".into()
                },
                Requirement::In {
                    key: "in".into(),
                    values: set(&["notin"])
                },
            ]
        );
        assert_eq!(sel(&selector.to_string()), selector);
    }

    #[test]
    fn empty_slots_in_a_set_are_the_empty_value() {
        assert_eq!(
            sel("k in ()").requirements()[0],
            Requirement::In {
                key: "k".into(),
                values: set(&[""])
            }
        );
        assert_eq!(sel("k in (a,)"), sel("k in (,a)"));
        assert_eq!(sel("k in (a,,b)").to_string(), "k in (,a,b)");
        assert_eq!(sel("k in (,a)").to_string(), "k in (,a)");
    }

    #[test]
    fn equals_matches_only_the_exact_value() {
        let s = sel("app=web");
        assert!(s.matches(&labels(&[("app", "web")])));
        assert!(!s.matches(&labels(&[("app", "api")])));
        assert!(!s.matches(&Labels::new()));
    }

    #[test]
    fn empty_value_matches_only_an_empty_label() {
        let s = sel("app=");
        assert!(s.matches(&labels(&[("app", "")])));
        assert!(!s.matches(&labels(&[("app", "web")])));
        assert!(!s.matches(&Labels::new()));
    }

    #[test]
    fn not_equals_matches_when_key_is_absent() {
        let s = sel("tier!=canary");
        assert!(s.matches(&Labels::new()));
        assert!(s.matches(&labels(&[("tier", "stable")])));
        assert!(!s.matches(&labels(&[("tier", "canary")])));
    }

    #[test]
    fn in_requirement_matches_any_listed_value() {
        let s = sel("env in (prod,staging)");
        assert!(s.matches(&labels(&[("env", "prod")])));
        assert!(s.matches(&labels(&[("env", "staging")])));
        assert!(!s.matches(&labels(&[("env", "dev")])));
        assert!(!s.matches(&Labels::new()));
    }

    #[test]
    fn notin_requirement_matches_when_key_is_absent() {
        let s = sel("env notin (prod,staging)");
        assert!(s.matches(&Labels::new()));
        assert!(s.matches(&labels(&[("env", "dev")])));
        assert!(!s.matches(&labels(&[("env", "prod")])));
    }

    #[test]
    fn exists_matches_any_value_including_empty() {
        let s = sel("gpu");
        assert!(s.matches(&labels(&[("gpu", "")])));
        assert!(s.matches(&labels(&[("gpu", "a100")])));
        assert!(!s.matches(&labels(&[("cpu", "x")])));
    }

    #[test]
    fn does_not_exist_matches_only_when_absent() {
        let s = sel("!legacy");
        assert!(s.matches(&labels(&[("app", "web")])));
        assert!(!s.matches(&labels(&[("legacy", "")])));
    }

    #[test]
    fn comma_means_all_requirements_must_match() {
        let s = sel("app=web,env in (prod)");
        assert!(s.matches(&labels(&[("app", "web"), ("env", "prod")])));
        assert!(!s.matches(&labels(&[("app", "web"), ("env", "dev")])));
        assert!(!s.matches(&labels(&[("env", "prod")])));
    }

    #[test]
    fn unexpected_token_after_value_points_at_it() {
        let e = err("app=we b");
        assert_eq!(e.position, 7);
        assert_eq!(e.message, "unexpected 'b', expected ',' or end of input");
        assert_eq!(
            e.to_string(),
            "invalid selector \"app=we b\" at position 7: \
             unexpected 'b', expected ',' or end of input"
        );
    }

    #[test]
    fn invalid_key_character_points_into_the_key() {
        let e = err("app=web, ti$r=db");
        assert_eq!(e.position, 11);
        assert_eq!(
            e.message,
            "invalid character '$' in label key \"ti$r\"; expected letters, digits, '-', '_' or '.'"
        );
    }

    #[test]
    fn invalid_value_character_points_into_the_value() {
        let e = err("env in (prod, st@ging)");
        assert_eq!(e.position, 16);
        assert!(e
            .message
            .contains("invalid character '@' in label value \"st@ging\""));
    }

    #[test]
    fn value_with_bad_boundary_points_at_it() {
        let e = err("app=web-");
        assert_eq!(e.position, 7);
        assert!(e.message.contains("must start and end with a letter or digit"));
    }

    #[test]
    fn too_long_value_points_at_its_start() {
        let e = err(&format!("app={}", "v".repeat(64)));
        assert_eq!(e.position, 4);
        assert_eq!(e.message, "label value is 64 characters long; the limit is 63");
    }

    #[test]
    fn uppercase_in_prefix_points_at_it() {
        let e = err("!x.IO/a");
        assert_eq!(e.position, 3);
        assert!(e.message.contains("in the prefix of label key \"x.IO/a\""));
    }

    #[test]
    fn trailing_comma_is_refused() {
        let e = err("app=web,");
        assert_eq!(e.position, 8);
        assert_eq!(e.message, "unexpected end of input, expected a label key or '!'");
    }

    #[test]
    fn leading_comma_is_refused() {
        let e = err(" ,app");
        assert_eq!(e.position, 1);
        assert_eq!(e.message, "unexpected ',', expected a label key or '!'");
    }

    #[test]
    fn bang_without_key_is_refused() {
        let e = err("!");
        assert_eq!(e.position, 1);
        assert_eq!(
            e.message,
            "unexpected end of input, expected a label key after '!'"
        );
    }

    #[test]
    fn missing_operator_is_refused() {
        let e = err("app web");
        assert_eq!(e.position, 4);
        assert_eq!(
            e.message,
            "unexpected 'web', expected an operator ('=', '==', '!=', 'in', 'notin'), \
             ',' or end of input"
        );
    }

    #[test]
    fn comparison_operators_are_not_supported() {
        let e = err("cpu>4");
        assert_eq!(e.position, 3);
        assert!(e.message.contains("invalid character '>' in label key \"cpu>4\""));
    }

    #[test]
    fn in_without_parenthesis_is_refused() {
        let e = err("env in prod");
        assert_eq!(e.position, 7);
        assert_eq!(e.message, "unexpected 'prod', expected '(' after 'in'");
        let e = err("env notin");
        assert_eq!(e.position, 9);
        assert_eq!(e.message, "unexpected end of input, expected '(' after 'notin'");
    }

    #[test]
    fn unclosed_set_is_refused() {
        let e = err("env in (prod");
        assert_eq!(e.position, 12);
        assert_eq!(e.message, "unexpected end of input, expected ',' or ')'");
        let e = err("env in (prod staging)");
        assert_eq!(e.position, 13);
        assert_eq!(e.message, "unexpected 'staging', expected ',' or ')'");
    }

    #[test]
    fn operator_inside_set_is_refused() {
        let e = err("env in (=)");
        assert_eq!(e.position, 8);
        assert_eq!(e.message, "unexpected '=', expected a label value, ',' or ')'");
    }

    #[test]
    fn operator_in_place_of_value_is_refused() {
        let e = err("app==(web)");
        assert_eq!(e.position, 5);
        assert_eq!(
            e.message,
            "unexpected '(', expected a label value, ',' or end of input"
        );
        let e = err("app===web");
        assert_eq!(e.position, 5);
        assert_eq!(
            e.message,
            "unexpected '=', expected a label value, ',' or end of input"
        );
    }

    #[test]
    fn spaced_bang_equals_is_not_not_equals() {
        let e = err("app ! = web");
        assert_eq!(e.position, 4);
        assert!(e.message.starts_with("unexpected '!', expected an operator"));
    }

    #[test]
    fn positions_count_characters_not_bytes() {
        let e = err("é=x");
        assert_eq!(e.position, 0);
        let e = err("a=é,b=ü");
        assert_eq!(e.position, 2);
        let e = err("a=x y");
        assert_eq!(e.position, 4);
        let e = err("a=é y");
        assert_eq!(e.position, 2);
    }

    #[test]
    fn selector_deserializes_from_text_and_reports_errors() {
        let de: StrDeserializer<'_, DeError> = "env in (staging,prod), app=web".into_deserializer();
        let selector = Selector::deserialize(de).unwrap();
        assert_eq!(selector, sel("env in (prod,staging),app=web"));

        let de: StrDeserializer<'_, DeError> = "app=we b".into_deserializer();
        let e = Selector::deserialize(de).unwrap_err();
        assert!(e.to_string().contains("at position 7"), "{e}");
    }

    #[test]
    fn selector_serializes_as_canonical_text() {
        let text: String = sel("app == web,!legacy").into();
        assert_eq!(text, "app=web,!legacy");
    }

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z]{1,2}",
            "[a-z]{1,3}(\\.[a-z0-9]{1,3})?/[A-Za-z0-9]([A-Za-z0-9._-]{0,3}[A-Za-z0-9])?",
            Just("in".to_owned()),
            Just("notin".to_owned()),
        ]
    }

    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            "[A-Za-z0-9]([A-Za-z0-9._-]{0,4}[A-Za-z0-9])?",
            Just("in".to_owned()),
        ]
    }

    fn requirement() -> impl Strategy<Value = Requirement> {
        prop_oneof![
            (key(), value()).prop_map(|(key, value)| Requirement::Equals { key, value }),
            (key(), value()).prop_map(|(key, value)| Requirement::NotEquals { key, value }),
            (key(), btree_set(value(), 1..4)).prop_map(|(key, values)| Requirement::In { key, values }),
            (key(), btree_set(value(), 1..4)).prop_map(|(key, values)| Requirement::NotIn { key, values }),
            key().prop_map(|key| Requirement::Exists { key }),
            key().prop_map(|key| Requirement::DoesNotExist { key }),
        ]
    }

    fn selector() -> impl Strategy<Value = Selector> {
        vec(requirement(), 0..5).prop_map(|requirements| Selector { requirements })
    }

    /// Labels over a tiny alphabet so that generated keys and values collide
    /// with the ones in generated requirements.
    fn small_labels() -> impl Strategy<Value = Labels> {
        btree_map("[ab]", prop_oneof![Just(String::new()), "[xy]"], 0..3)
    }

    /// Renders `selector` with generous whitespace everywhere it is allowed.
    fn spaced(selector: &Selector) -> String {
        let parts: Vec<String> = selector
            .requirements()
            .iter()
            .map(|r| match r {
                Requirement::Equals { key, value } => format!(" {key} == {value} "),
                Requirement::NotEquals { key, value } => format!("\t{key} != {value}\n"),
                Requirement::In { key, values } => format!(
                    " {key}  in ( {} ) ",
                    values.iter().cloned().collect::<Vec<_>>().join(" , ")
                ),
                Requirement::NotIn { key, values } => format!(
                    " {key} notin\t({} )",
                    values.iter().cloned().collect::<Vec<_>>().join(", ")
                ),
                Requirement::Exists { key } => format!("  {key} "),
                Requirement::DoesNotExist { key } => format!(" ! {key} "),
            })
            .collect();
        parts.join(" , ")
    }

    proptest! {
        #[test]
        fn display_parses_back_to_an_equal_selector(s in selector()) {
            let text = s.to_string();
            prop_assert_eq!(text.parse::<Selector>(), Ok(s));
        }

        #[test]
        fn whitespace_does_not_change_the_parse(s in selector()) {
            prop_assert_eq!(spaced(&s).parse::<Selector>(), Ok(s));
        }

        #[test]
        fn equals_and_not_equals_are_complements(
            key in "[ab]", value in prop_oneof![Just(String::new()), "[xy]"], l in small_labels()
        ) {
            let eq = Requirement::Equals { key: key.clone(), value: value.clone() };
            let ne = Requirement::NotEquals { key, value };
            prop_assert_ne!(eq.matches(&l), ne.matches(&l));
        }

        #[test]
        fn in_and_notin_are_complements(
            key in "[ab]",
            values in btree_set(prop_oneof![Just(String::new()), "[xy]"], 1..3),
            l in small_labels(),
        ) {
            let inn = Requirement::In { key: key.clone(), values: values.clone() };
            let notin = Requirement::NotIn { key, values };
            prop_assert_ne!(inn.matches(&l), notin.matches(&l));
        }

        #[test]
        fn exists_and_does_not_exist_are_complements(key in "[ab]", l in small_labels()) {
            let exists = Requirement::Exists { key: key.clone() };
            let absent = Requirement::DoesNotExist { key };
            prop_assert_ne!(exists.matches(&l), absent.matches(&l));
        }

        #[test]
        fn in_with_one_value_is_equals(key in "[ab]", value in "[xy]", l in small_labels()) {
            let inn = sel(&format!("{key} in ({value})"));
            let eq = sel(&format!("{key}={value}"));
            prop_assert_eq!(inn.matches(&l), eq.matches(&l));
        }

        #[test]
        fn selector_matches_iff_every_requirement_matches(
            s in selector(), l in small_labels()
        ) {
            let each = s.requirements().iter().all(|r| r.matches(&l));
            prop_assert_eq!(s.matches(&l), each);
        }

        /// Why access rules must require a label: no such selector admits
        /// a VM without labels...
        #[test]
        fn no_selector_that_requires_a_label_matches_the_empty_label_set(s in selector()) {
            if s.require_label().is_ok() {
                prop_assert!(!s.matches(&Labels::new()));
            }
        }

        /// ...and every other one does: the check refuses exactly the
        /// selectors that fail open.
        #[test]
        fn a_selector_that_requires_no_label_matches_the_empty_label_set(s in selector()) {
            prop_assert_eq!(s.require_label().is_err(), s.matches(&Labels::new()));
        }

        /// Nor does it admit a VM that merely lacks the labels it requires:
        /// whatever it matches carries the key of a requirement to carry.
        #[test]
        fn what_a_selector_requiring_a_label_matches_carries_one(
            s in selector(), l in small_labels()
        ) {
            if s.requires_a_label() && s.matches(&l) {
                prop_assert!(s
                    .requirements()
                    .iter()
                    .any(|r| r.requires_the_label() && l.contains_key(r.key())));
            }
        }

        #[test]
        fn labels_written_as_equalities_select_themselves(l in small_labels()) {
            let text: Vec<String> = l.iter().map(|(k, v)| format!("{k}={v}")).collect();
            prop_assert!(sel(&text.join(",")).matches(&l));
        }

        #[test]
        fn arbitrary_input_never_panics_and_errors_point_inside(s in ".{0,40}") {
            if let Err(e) = s.parse::<Selector>() {
                prop_assert!(e.position <= s.chars().count());
            }
        }

        #[test]
        fn selector_like_input_never_panics(s in "[a-c!=,() \\-.$/]{0,20}|(in|notin|[ !=,()a])*") {
            if let Ok(selector) = s.parse::<Selector>() {
                prop_assert_eq!(selector.to_string().parse::<Selector>(), Ok(selector));
            }
        }
    }
}
