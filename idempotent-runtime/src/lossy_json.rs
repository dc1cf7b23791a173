//! Whether serde_json would write a value in a way that reads back as another one:
//! a NaN or an infinite float (written as `null`, so an `Option<f64>` holding one
//! reads back as `None`), or a `Some` of something written as `null` (`Some(None)`,
//! `Some(())`, `Some(Value::Null)`: `null` reads back as `None`).

use std::fmt;

use serde::Serialize;
use serde::ser;

/// Why serde_json's text of `value` would read back as another value, if it would (a
/// value whose `Serialize` fails is not reported here).
pub(crate) fn lossy<T: Serialize + ?Sized>(value: &T) -> Option<&'static str> {
    match value.serialize(Check) {
        Err(Stop::NonFinite) => Some("it holds a NaN or infinite float, which JSON writes as null"),
        Err(Stop::SomeNull) => {
            Some("it holds a Some of a value JSON writes as null, which reads back as None")
        }
        _ => None,
    }
}

/// Why the walk stopped.
#[derive(Debug)]
enum Stop {
    NonFinite,
    SomeNull,
    /// Not `null` ([`IsNull`]'s answer).
    NotNull,
    Other,
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stop::NonFinite => "a non-finite float",
            Stop::SomeNull => "a Some written as null",
            Stop::NotNull => "not null",
            Stop::Other => "the value failed to serialize",
        })
    }
}

impl std::error::Error for Stop {}

impl ser::Error for Stop {
    fn custom<M: fmt::Display>(_: M) -> Stop {
        Stop::Other
    }
}

/// Walks a value, writing nothing.
#[derive(Clone, Copy)]
struct Check;

fn float(finite: bool) -> Result<(), Stop> {
    if finite { Ok(()) } else { Err(Stop::NonFinite) }
}

macro_rules! scalars {
    ($($method:ident($ty:ty)),*) => {
        $(fn $method(self, _: $ty) -> Result<(), Stop> { Ok(()) })*
    };
}

impl ser::Serializer for Check {
    type Ok = ();
    type Error = Stop;
    type SerializeSeq = Check;
    type SerializeTuple = Check;
    type SerializeTupleStruct = Check;
    type SerializeTupleVariant = Check;
    type SerializeMap = Check;
    type SerializeStruct = Check;
    type SerializeStructVariant = Check;

    scalars!(
        serialize_bool(bool),
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_i128(i128),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
        serialize_u128(u128),
        serialize_char(char),
        serialize_str(&str),
        serialize_bytes(&[u8]),
        serialize_unit_struct(&'static str)
    );

    fn serialize_f32(self, v: f32) -> Result<(), Stop> {
        float(v.is_finite())
    }
    fn serialize_f64(self, v: f64) -> Result<(), Stop> {
        float(v.is_finite())
    }
    fn serialize_none(self) -> Result<(), Stop> {
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Stop> {
        match value.serialize(IsNull) {
            Ok(()) => Err(Stop::SomeNull),
            Err(_) => value.serialize(self),
        }
    }
    fn serialize_unit(self) -> Result<(), Stop> {
        Ok(())
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, _: &'static str) -> Result<(), Stop> {
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), Stop> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        value: &T,
    ) -> Result<(), Stop> {
        value.serialize(self)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Check, Stop> {
        Ok(self)
    }
    fn serialize_tuple(self, _: usize) -> Result<Check, Stop> {
        Ok(self)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Check, Stop> {
        Ok(self)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Check, Stop> {
        Ok(self)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Check, Stop> {
        Ok(self)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Check, Stop> {
        Ok(self)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Check, Stop> {
        Ok(self)
    }
}

/// The compound serializers: every element, key and field is walked the same way.
macro_rules! compound {
    ($($trait:ident::$method:ident$(($key:ty))?),*) => {
        $(impl ser::$trait for Check {
            type Ok = ();
            type Error = Stop;
            fn $method<T: Serialize + ?Sized>(&mut self, $(_: $key,)? value: &T) -> Result<(), Stop> {
                value.serialize(Check)
            }
            fn end(self) -> Result<(), Stop> {
                Ok(())
            }
        })*
    };
}

compound!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field,
    SerializeStruct::serialize_field(&'static str),
    SerializeStructVariant::serialize_field(&'static str)
);

impl ser::SerializeMap for Check {
    type Ok = ();
    type Error = Stop;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Stop> {
        key.serialize(Check)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Stop> {
        value.serialize(Check)
    }
    fn end(self) -> Result<(), Stop> {
        Ok(())
    }
}

/// Answers `Ok` when a value is written as `null` by serde_json (none, unit, a unit
/// struct, or a newtype or `Some` of one), and stops with [`Stop::NotNull`] at the
/// first sign of anything else, without walking it.
struct IsNull;

macro_rules! not_null {
    ($($method:ident($($ty:ty),*)),*) => {
        $(fn $method(self, $(_: $ty),*) -> Result<(), Stop> { Err(Stop::NotNull) })*
    };
}

impl ser::Serializer for IsNull {
    type Ok = ();
    type Error = Stop;
    type SerializeSeq = ser::Impossible<(), Stop>;
    type SerializeTuple = ser::Impossible<(), Stop>;
    type SerializeTupleStruct = ser::Impossible<(), Stop>;
    type SerializeTupleVariant = ser::Impossible<(), Stop>;
    type SerializeMap = ser::Impossible<(), Stop>;
    type SerializeStruct = ser::Impossible<(), Stop>;
    type SerializeStructVariant = ser::Impossible<(), Stop>;

    not_null!(
        serialize_bool(bool),
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_i128(i128),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
        serialize_u128(u128),
        serialize_f32(f32),
        serialize_f64(f64),
        serialize_char(char),
        serialize_str(&str),
        serialize_bytes(&[u8]),
        serialize_unit_variant(&'static str, u32, &'static str)
    );

    fn serialize_none(self) -> Result<(), Stop> {
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Stop> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Stop> {
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Stop> {
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), Stop> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<(), Stop> {
        Err(Stop::NotNull)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, Stop> {
        Err(Stop::NotNull)
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, Stop> {
        Err(Stop::NotNull)
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, Stop> {
        Err(Stop::NotNull)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Stop> {
        Err(Stop::NotNull)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, Stop> {
        Err(Stop::NotNull)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeStruct, Stop> {
        Err(Stop::NotNull)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Stop> {
        Err(Stop::NotNull)
    }
}
