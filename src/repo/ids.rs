//! Document ids as the server compares them.
//!
//! MongoDB compares numbers by value across types: Int32 7, Int64 7, Double 7.0 and Decimal128 7
//! are one `_id`, and so are embedded documents and arrays made of such numbers. Anything that keys
//! by id on the client (staging one entry per document, lock order, finding a document's entry)
//! must agree, or two entries for one document pass as two documents and one write is lost. So
//! ids are compared by a canonical form: integral numbers that fit an `i64` exactly become Int64,
//! other numbers Double, recursively; every other value stays as it is.

use bson::{Bson, Document};

/// The canonical form of `id` under the server's equality.
pub(crate) fn canonical(id: &Bson) -> Bson {
    match id {
        Bson::Int32(v) => Bson::Int64(i64::from(*v)),
        Bson::Int64(v) => Bson::Int64(*v),
        Bson::Double(v) => canonical_double(*v),
        Bson::Decimal128(d) => match d.to_string().parse::<i64>() {
            Ok(v) => Bson::Int64(v),
            Err(_) => match d.to_string().parse::<f64>() {
                Ok(v) if v.is_finite() => canonical_double(v),
                _ => id.clone(),
            },
        },
        Bson::Document(doc) => Bson::Document(
            doc.iter()
                .map(|(k, v)| (k.clone(), canonical(v)))
                .collect::<Document>(),
        ),
        Bson::Array(items) => Bson::Array(items.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

fn canonical_double(v: f64) -> Bson {
    // 2^63 is exactly representable; anything integral strictly inside (-2^63, 2^63) converts exactly.
    const LIMIT: f64 = 9_223_372_036_854_775_808.0;
    if v.fract() == 0.0 && v > -LIMIT && v < LIMIT {
        Bson::Int64(v as i64)
    } else {
        Bson::Double(v)
    }
}

/// A string key for `id` that is equal for exactly the ids the server treats as one, and orders
/// them the same way in every process (lock order).
pub(crate) fn key(id: &Bson) -> String {
    canonical(id).into_canonical_extjson().to_string()
}

/// Whether the server treats `a` and `b` as the same `_id`.
pub(crate) fn same(a: &Bson, b: &Bson) -> bool {
    // Not `==` on the canonical values: `Document` equality ignores field order, the server's
    // does not.
    key(a) == key(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    #[test]
    fn numbers_equal_by_value_are_one_id() {
        let seven = [
            Bson::Int32(7),
            Bson::Int64(7),
            Bson::Double(7.0),
            Bson::Decimal128("7".parse().expect("decimal")),
        ];
        for a in &seven {
            for b in &seven {
                assert!(same(a, b), "{a:?} vs {b:?}");
                assert_eq!(key(a), key(b));
            }
        }
        assert!(!same(&Bson::Double(7.5), &Bson::Int64(7)));
        assert!(!same(&Bson::String("7".into()), &Bson::Int64(7)));
        assert!(same(&Bson::Double(-0.0), &Bson::Int32(0)));
    }

    #[test]
    fn embedded_numbers_are_canonical_too() {
        assert!(same(
            &Bson::Document(doc! { "a": 1_i32, "b": [2.0, "x"] }),
            &Bson::Document(doc! { "a": 1_i64, "b": [2_i32, "x"] }),
        ));
        // Field order matters to the server, so it matters here.
        assert!(!same(
            &Bson::Document(doc! { "a": 1, "b": 2 }),
            &Bson::Document(doc! { "b": 2, "a": 1 }),
        ));
    }

    #[test]
    fn huge_doubles_stay_doubles() {
        assert_eq!(canonical(&Bson::Double(1e300)), Bson::Double(1e300));
        assert_eq!(canonical(&Bson::Double(0.5)), Bson::Double(0.5));
        assert_eq!(canonical(&Bson::Double(-42.0)), Bson::Int64(-42));
    }
}
