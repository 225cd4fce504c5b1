//! A serde `Deserializer` adapter that refuses a sequence wherever a struct
//! is asked for, at any depth, so that a request body is checked in the
//! same pass that reads it.
//!
//! Serde reads a struct from a sequence too, positionally: `["arr2","admin"]`
//! would be a `CreateUserRequest` named `arr2` with the role `admin`. The API
//! takes objects only. [`Objects`] wraps another deserializer (serde_json's)
//! and every visitor, `SeqAccess`, `MapAccess`, `EnumAccess`, `VariantAccess`
//! and nested deserializer it hands on, as `serde_ignored` and
//! `serde_path_to_error` do; where a struct, a struct variant or an
//! internally tagged enum is read and the input holds a sequence, it fails
//! with [`ARRAY_FOR_OBJECT`] and records that it did in the shared
//! [`Found`], so the caller knows the error is this refusal (not a message
//! a client could have written into a value).
//!
//! What it cannot see: content serde buffers before reading it (untagged
//! enums, `flatten`, the fields of an internally tagged enum's variant) is
//! read from serde's own buffer, not through this adapter. The request types
//! have no untagged enum and no `flatten`; the one internally tagged enum
//! (`SessionEvent`) has no struct inside its variants. Its sequence form
//! itself is refused (its visitor says "internally tagged enum").

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Visitor};

/// The refusal, without its place (the caller names the path).
pub const ARRAY_FOR_OBJECT: &str = "expected a JSON object, found an array";

/// Set when [`Objects`] refused a sequence: the error that comes out of the
/// parse is that refusal.
#[derive(Debug, Default)]
pub struct Found(Cell<bool>);

impl Found {
    pub fn get(&self) -> bool {
        self.0.get()
    }

    fn refuse<E: de::Error>(&self) -> E {
        self.0.set(true);
        E::custom(ARRAY_FOR_OBJECT)
    }
}

/// The adapter: `D` with a sequence refused where a struct is read.
pub struct Objects<'a, D> {
    de: D,
    found: &'a Found,
}

impl<'a, D> Objects<'a, D> {
    pub fn new(de: D, found: &'a Found) -> Self {
        Objects { de, found }
    }
}

/// What the wrapped visitor was asked to read: whether a sequence is
/// refused when the input holds one.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wants {
    /// A struct or a struct variant: never from a sequence.
    Struct,
    /// Whatever the input holds (`deserialize_any`): a sequence is refused
    /// only for an internally tagged enum, which serde would read
    /// positionally (its tag first).
    Any,
    /// Anything else: a sequence is what it asks for, or its own refusal.
    Other,
}

/// `deserialize_*` methods that only wrap the visitor.
macro_rules! forward {
    ($($method:ident ( $($arg:ident : $ty:ty),* ),)*) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, D::Error> {
            self.de.$method($($arg,)* Wrap::new(visitor, self.found, Wants::Other))
        }
    )*};
}

impl<'de, D: de::Deserializer<'de>> de::Deserializer<'de> for Objects<'_, D> {
    type Error = D::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        self.de
            .deserialize_any(Wrap::new(visitor, self.found, Wants::Any))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.de
            .deserialize_struct(name, fields, Wrap::new(visitor, self.found, Wants::Struct))
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        // Nothing is read from what is ignored.
        self.de.deserialize_ignored_any(visitor)
    }

    fn is_human_readable(&self) -> bool {
        self.de.is_human_readable()
    }

    forward! {
        deserialize_bool(),
        deserialize_i8(),
        deserialize_i16(),
        deserialize_i32(),
        deserialize_i64(),
        deserialize_i128(),
        deserialize_u8(),
        deserialize_u16(),
        deserialize_u32(),
        deserialize_u64(),
        deserialize_u128(),
        deserialize_f32(),
        deserialize_f64(),
        deserialize_char(),
        deserialize_str(),
        deserialize_string(),
        deserialize_bytes(),
        deserialize_byte_buf(),
        deserialize_option(),
        deserialize_unit(),
        deserialize_unit_struct(name: &'static str),
        deserialize_newtype_struct(name: &'static str),
        deserialize_seq(),
        deserialize_tuple(len: usize),
        deserialize_tuple_struct(name: &'static str, len: usize),
        deserialize_map(),
        deserialize_enum(name: &'static str, variants: &'static [&'static str]),
        deserialize_identifier(),
    }
}

/// A visitor whose nested input goes through [`Objects`] too.
struct Wrap<'a, V> {
    visitor: V,
    found: &'a Found,
    wants: Wants,
}

impl<'a, V> Wrap<'a, V> {
    fn new(visitor: V, found: &'a Found, wants: Wants) -> Self {
        Wrap {
            visitor,
            found,
            wants,
        }
    }
}

/// A visitor's own description (`Visitor::expecting`) as text.
struct Expecting<'a, V>(&'a V);

impl<'de, V: Visitor<'de>> fmt::Display for Expecting<'_, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.expecting(f)
    }
}

/// Primitive `visit_*` methods, handed on unchanged.
macro_rules! pass {
    ($($method:ident ( $ty:ty ),)*) => {$(
        fn $method<E: de::Error>(self, v: $ty) -> Result<V::Value, E> {
            self.visitor.$method(v)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Wrap<'_, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.visitor.expecting(f)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        let refused = match self.wants {
            Wants::Struct => true,
            // serde_derive's visitor for an internally tagged enum describes
            // itself so (unless the type sets its own `expecting`): only a
            // sequence reaches this, so the text is formatted rarely.
            Wants::Any => Expecting(&self.visitor)
                .to_string()
                .starts_with("internally tagged enum"),
            Wants::Other => false,
        };
        if refused {
            return Err(self.found.refuse());
        }
        self.visitor.visit_seq(Seq {
            seq,
            found: self.found,
        })
    }

    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.visitor.visit_map(Map {
            map,
            found: self.found,
        })
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        self.visitor.visit_enum(Enum {
            data,
            found: self.found,
        })
    }

    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        self.visitor.visit_some(Objects::new(d, self.found))
    }

    fn visit_newtype_struct<D: de::Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        self.visitor.visit_newtype_struct(Objects::new(d, self.found))
    }

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.visitor.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.visitor.visit_unit()
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<V::Value, E> {
        self.visitor.visit_borrowed_str(v)
    }

    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<V::Value, E> {
        self.visitor.visit_borrowed_bytes(v)
    }

    pass! {
        visit_bool(bool),
        visit_i8(i8),
        visit_i16(i16),
        visit_i32(i32),
        visit_i64(i64),
        visit_i128(i128),
        visit_u8(u8),
        visit_u16(u16),
        visit_u32(u32),
        visit_u64(u64),
        visit_u128(u128),
        visit_f32(f32),
        visit_f64(f64),
        visit_char(char),
        visit_str(&str),
        visit_string(String),
        visit_bytes(&[u8]),
        visit_byte_buf(Vec<u8>),
    }
}

/// A seed whose deserializer is wrapped in [`Objects`].
struct Seed<'a, S> {
    seed: S,
    found: &'a Found,
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<'_, S> {
    type Value = S::Value;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        self.seed.deserialize(Objects::new(d, self.found))
    }
}

struct Seq<'a, A> {
    seq: A,
    found: &'a Found,
}

impl<'de, A: de::SeqAccess<'de>> de::SeqAccess<'de> for Seq<'_, A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, A::Error> {
        self.seq.next_element_seed(Seed {
            seed,
            found: self.found,
        })
    }

    fn size_hint(&self) -> Option<usize> {
        self.seq.size_hint()
    }
}

struct Map<'a, A> {
    map: A,
    found: &'a Found,
}

impl<'de, A: de::MapAccess<'de>> de::MapAccess<'de> for Map<'_, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        self.map.next_key_seed(Seed {
            seed,
            found: self.found,
        })
    }

    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        self.map.next_value_seed(Seed {
            seed,
            found: self.found,
        })
    }

    fn size_hint(&self) -> Option<usize> {
        self.map.size_hint()
    }
}

struct Enum<'a, A> {
    data: A,
    found: &'a Found,
}

impl<'a, 'de, A: de::EnumAccess<'de>> de::EnumAccess<'de> for Enum<'a, A> {
    type Error = A::Error;
    type Variant = Variant<'a, A::Variant>;

    fn variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<(T::Value, Self::Variant), A::Error> {
        let found = self.found;
        self.data
            .variant_seed(Seed { seed, found })
            .map(|(value, variant)| (value, Variant { variant, found }))
    }
}

struct Variant<'a, A> {
    variant: A,
    found: &'a Found,
}

impl<'de, A: de::VariantAccess<'de>> de::VariantAccess<'de> for Variant<'_, A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.variant.unit_variant()
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, A::Error> {
        self.variant.newtype_variant_seed(Seed {
            seed,
            found: self.found,
        })
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        self.variant
            .tuple_variant(len, Wrap::new(visitor, self.found, Wants::Other))
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        self.variant
            .struct_variant(fields, Wrap::new(visitor, self.found, Wants::Struct))
    }
}
