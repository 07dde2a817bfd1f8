//! How the validator compares and shows BSON values: numbers ordered exactly across int, long,
//! double and decimal (an `i64` beyond 2^53 against a double included), `multipleOf` arithmetic,
//! MongoDB's equality for `enum` and `uniqueItems`, and the short form a value takes in messages.

use std::cmp::Ordering;

use bson::Bson;

use crate::repo::schema::types::BsonType;

/// A number in a form that compares across BSON numeric types.
enum Number {
    Int(i64),
    Float(f64),
}

fn number(b: &Bson) -> Option<Number> {
    match b {
        Bson::Int32(i) => Some(Number::Int(i64::from(*i))),
        Bson::Int64(i) => Some(Number::Int(*i)),
        Bson::Double(f) => Some(Number::Float(*f)),
        // Decimal128 has no arithmetic in the bson crate; its text form parses closely enough
        // for range checks.
        Bson::Decimal128(d) => d.to_string().parse::<f64>().ok().map(Number::Float),
        _ => None,
    }
}

pub(super) fn compare_numbers(a: &Bson, b: &Bson) -> Option<Ordering> {
    match (number(a)?, number(b)?) {
        (Number::Int(x), Number::Int(y)) => Some(x.cmp(&y)),
        (Number::Int(x), Number::Float(y)) => compare_int_float(x, y),
        (Number::Float(x), Number::Int(y)) => compare_int_float(y, x).map(Ordering::reverse),
        (Number::Float(x), Number::Float(y)) => x.partial_cmp(&y),
    }
}

/// Compares an integer with a float exactly, even where the integer does not fit an `f64`.
fn compare_int_float(i: i64, f: f64) -> Option<Ordering> {
    if f.is_nan() {
        return None;
    }
    // 2^63 as f64; every i64 is below it.
    const TWO_63: f64 = 9_223_372_036_854_775_808.0;
    if f >= TWO_63 {
        return Some(Ordering::Less);
    }
    if f < -TWO_63 {
        return Some(Ordering::Greater);
    }
    let whole = f.trunc();
    // In range, so the cast is exact.
    let w = whole as i64;
    match i.cmp(&w) {
        Ordering::Equal => 0.0f64.partial_cmp(&(f - whole)),
        other => Some(other),
    }
}

pub(super) fn is_multiple(n: &Bson, m: &Bson) -> bool {
    match (number(n), number(m)) {
        (Some(Number::Int(x)), Some(Number::Int(y))) => y != 0 && x % y == 0,
        (Some(x), Some(y)) => {
            let x = as_f64(&x);
            let y = as_f64(&y);
            y != 0.0 && x.is_finite() && (x / y).fract() == 0.0
        }
        _ => false,
    }
}

fn as_f64(n: &Number) -> f64 {
    match n {
        Number::Int(i) => *i as f64,
        Number::Float(f) => *f,
    }
}

/// Equality as MongoDB applies it to `enum` and `uniqueItems`: numbers compare by value across
/// types, documents compare field by field in order.
pub(super) fn bson_equal(a: &Bson, b: &Bson) -> bool {
    if BsonType::of(a).is_numeric() && BsonType::of(b).is_numeric() {
        return compare_numbers(a, b) == Some(Ordering::Equal);
    }
    match (a, b) {
        (Bson::Document(x), Bson::Document(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y.iter())
                    .all(|((ka, va), (kb, vb))| ka == kb && bson_equal(va, vb))
        }
        (Bson::Array(x), Bson::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y.iter()).all(|(p, q)| bson_equal(p, q))
        }
        _ => a == b,
    }
}

pub(super) fn show_value(value: &Bson) -> String {
    let text = value.clone().into_relaxed_extjson().to_string();
    if text.chars().count() > 60 {
        let cut: String = text.chars().take(57).collect();
        format!("{cut}...")
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_compare_across_types() {
        assert!(bson_equal(&Bson::Int32(3), &Bson::Double(3.0)));
        assert!(bson_equal(&Bson::Int64(3), &Bson::Int32(3)));
        assert!(!bson_equal(&Bson::Int64(3), &Bson::String("3".into())));
        assert_eq!(
            compare_numbers(&Bson::Int64(i64::MAX), &Bson::Double(i64::MAX as f64)),
            Some(Ordering::Less)
        );
        assert_eq!(
            compare_numbers(&Bson::Int64(2), &Bson::Double(2.5)),
            Some(Ordering::Less)
        );
        assert_eq!(
            compare_numbers(&Bson::Double(-2.5), &Bson::Int64(-2)),
            Some(Ordering::Less)
        );
        assert_eq!(
            compare_numbers(&Bson::Double(f64::NAN), &Bson::Int64(0)),
            None
        );
    }
}
