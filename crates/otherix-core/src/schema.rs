//! OpenAPI schemas of the core types the wire protocol carries (the
//! `schema` feature, which `otherix-proto` turns on): each is a string with
//! a format and an example.

use std::borrow::Cow;

use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::openapi::RefOr;

macro_rules! string_schema {
    ($ty:ty, $name:literal, $description:literal, $example:literal) => {
        impl utoipa::PartialSchema for $ty {
            fn schema() -> RefOr<Schema> {
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .description(Some($description))
                    .examples([serde_json::json!($example)])
                    .into()
            }
        }

        impl utoipa::ToSchema for $ty {
            fn name() -> Cow<'static, str> {
                Cow::Borrowed($name)
            }
        }
    };
}

string_schema!(
    crate::MacAddr,
    "MacAddr",
    "An Ethernet MAC address.",
    "02:5e:10:00:00:01"
);
string_schema!(
    crate::Subnet,
    "Subnet",
    "An IPv4 subnet: its network address and prefix length.",
    "10.100.0.0/24"
);
string_schema!(
    crate::Ipv4Cidr,
    "Ipv4Cidr",
    "An interface address: an IPv4 address and its network's prefix length.",
    "10.100.0.5/24"
);

/// A name's schema: a DNS label, with its pattern and length limit.
pub(crate) fn name_schema(description: &'static str, example: &'static str) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some(description))
        .pattern(Some("^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"))
        .max_length(Some(crate::names::MAX_NAME_LEN))
        .examples([serde_json::json!(example)])
        .into()
}
