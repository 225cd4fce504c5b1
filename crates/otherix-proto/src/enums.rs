//! The closed sets of words the protocol uses, as enums: each serializes as
//! its lower-case (snake_case) name, shows as that name, parses from it, and
//! appears in the OpenAPI document as an enum.

/// A word that is none of an enum's names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownWord {
    /// What the word names, e.g. "transport".
    pub what: &'static str,
    pub word: String,
    /// The names it may be.
    pub expected: &'static [&'static str],
}

impl std::fmt::Display for UnknownWord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unknown {} {:?}; expected ", self.what, self.word)?;
        for (i, name) in self.expected.iter().enumerate() {
            match i {
                0 => {}
                i if i + 1 == self.expected.len() => f.write_str(" or ")?,
                _ => f.write_str(", ")?,
            }
            f.write_str(name)?;
        }
        Ok(())
    }
}

impl std::error::Error for UnknownWord {}

/// Defines a wire enum: the variants with their names, `as_str`, `ALL`,
/// `Display`, `FromStr` (whose error is [`UnknownWord`]) and its OpenAPI
/// schema: a string enum of the wire words.
///
/// The schema is written out here rather than derived: `utoipa::ToSchema`'s
/// derive does not see a `#[serde(rename = $word)]` whose word comes through
/// a macro fragment, and published the Rust names (`Pending`) while the wire
/// carried the words (`pending`). The enum's doc comment is its description.
#[macro_export]
macro_rules! wire_enum {
    (
        $(#[doc = $doc:literal])*
        $vis:vis enum $name:ident : $what:literal {
            $( $(#[$vmeta:meta])* $variant:ident = $word:literal, )+
        }
    ) => {
        $(#[doc = $doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord,
                 serde::Serialize, serde::Deserialize)]
        $vis enum $name {
            $( $(#[$vmeta])* #[serde(rename = $word)] $variant, )+
        }

        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                let description: &[&str] = &[$($doc),*];
                let description = description
                    .iter()
                    .map(|line| line.trim())
                    .collect::<Vec<_>>()
                    .join(" ");
                utoipa::openapi::schema::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .description((!description.is_empty()).then_some(description))
                    .enum_values(Some($name::WORDS.iter().copied()))
                    .into()
            }
        }

        impl utoipa::ToSchema for $name {
            fn name() -> std::borrow::Cow<'static, str> {
                std::borrow::Cow::Borrowed(stringify!($name))
            }
        }

        impl $name {
            /// Every variant, in order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            const WORDS: &'static [&'static str] = &[$($word),+];

            /// The wire name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $word,)+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = $crate::enums::UnknownWord;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($word => Ok($name::$variant),)+
                    other => Err($crate::enums::UnknownWord {
                        what: $what,
                        word: other.to_string(),
                        expected: $name::WORDS,
                    }),
                }
            }
        }
    };
}

#[cfg(test)]
mod tests {
    wire_enum! {
        /// A test enum.
        pub enum Colour: "colour" {
            Red = "red",
            DarkBlue = "dark_blue",
            Green = "green",
        }
    }

    #[test]
    fn names_round_trip_through_text_and_json() {
        for c in Colour::ALL {
            assert_eq!(c.as_str().parse::<Colour>().unwrap(), *c);
            let json = serde_json::to_string(c).unwrap();
            assert_eq!(json, format!("\"{c}\""));
            assert_eq!(serde_json::from_str::<Colour>(&json).unwrap(), *c);
        }
    }

    #[test]
    fn the_schema_lists_the_wire_words() {
        use utoipa::PartialSchema;
        let schema = serde_json::to_value(Colour::schema()).unwrap();
        assert_eq!(schema["type"], "string");
        assert_eq!(schema["enum"], serde_json::json!(["red", "dark_blue", "green"]));
        assert_eq!(schema["description"], "A test enum.");
    }

    #[test]
    fn an_unknown_word_says_what_it_could_be() {
        let e = "blue".parse::<Colour>().unwrap_err();
        assert_eq!(
            e.to_string(),
            r#"unknown colour "blue"; expected red, dark_blue or green"#
        );
        assert!(serde_json::from_str::<Colour>("\"blue\"").is_err());
    }
}
