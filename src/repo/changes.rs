//! Field-level changes: `Update` (set / unset) and `Adjust` (numeric increments).
//!
//! Paths are top-level names or dotted paths through embedded documents ("address.city").
//! Array positions are not addressable: a transaction must be able to record and restore the
//! original value of every path it touches, and positional paths shift under concurrent edits.

use bson::{doc, Bson, Document};

use crate::repo::schema::Violation;

/// Fields to set and fields to remove, applied atomically to one document.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Update {
    pub(crate) set: Vec<(String, Bson)>,
    pub(crate) unset: Vec<String>,
}

impl Update {
    /// An empty update.
    pub fn new() -> Update {
        Update::default()
    }

    /// Sets the field at `path` to `value` (use `bson::to_bson` for serde values).
    pub fn set(mut self, path: impl Into<String>, value: impl Into<Bson>) -> Update {
        self.set.push((path.into(), value.into()));
        self
    }

    /// Removes the field at `path`.
    pub fn unset(mut self, path: impl Into<String>) -> Update {
        self.unset.push(path.into());
        self
    }

    /// Whether nothing would change.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.unset.is_empty()
    }

    /// The fields to set, in the order given.
    pub fn sets(&self) -> &[(String, Bson)] {
        &self.set
    }

    /// The fields to remove, in the order given.
    pub fn unsets(&self) -> &[String] {
        &self.unset
    }

    /// Every path the update touches.
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.set
            .iter()
            .map(|(p, _)| p.as_str())
            .chain(self.unset.iter().map(String::as_str))
    }

    /// Applies the update to an in-memory document, as the server would.
    pub(crate) fn apply_to(&self, doc: &mut Document) -> Result<(), Violation> {
        for (path, value) in &self.set {
            set_path(doc, path, value.clone()).map_err(|reason| Violation {
                field: path.clone(),
                reason,
            })?;
        }
        for path in &self.unset {
            unset_path(doc, path);
        }
        Ok(())
    }
}

/// Numeric increments, applied atomically to one document.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Adjust {
    pub(crate) by: Vec<(String, Bson)>,
}

impl Adjust {
    /// An empty adjustment.
    pub fn new() -> Adjust {
        Adjust::default()
    }

    /// Adds `amount` (an `i32`, `i64` or finite `f64`) to the number at `path`.
    pub fn by(mut self, path: impl Into<String>, amount: impl Into<Bson>) -> Adjust {
        self.by.push((path.into(), amount.into()));
        self
    }

    /// Whether nothing would change.
    pub fn is_empty(&self) -> bool {
        self.by.is_empty()
    }

    /// The increments, in the order given.
    pub fn increments(&self) -> &[(String, Bson)] {
        &self.by
    }

    /// Applies the increments to an in-memory document, as the server would.
    pub(crate) fn apply_to(&self, doc: &mut Document) -> Result<(), Violation> {
        for (path, amount) in &self.by {
            increment_path(doc, path, amount).map_err(|reason| Violation {
                field: path.clone(),
                reason,
            })?;
        }
        Ok(())
    }

    /// Filter clauses that hold exactly when every increment can be applied: the field is
    /// missing or a number, and a whole-number increment does not take a stored whole number past
    /// the 64-bit range. MongoDB refuses an `$inc` of anything else (and a server that wraps
    /// around would store a wrong number), so the write is sent with these and matches nothing
    /// instead; the caller then reads the document and says which increment and why.
    pub(crate) fn applicable(&self) -> Vec<Document> {
        self.by
            .iter()
            .map(|(path, amount)| {
                let whole = match amount {
                    Bson::Int32(n) => i64::from(*n),
                    Bson::Int64(n) => *n,
                    _ => 0,
                };
                let mut number = doc! { "$type": "number" };
                let beyond = match whole.cmp(&0) {
                    std::cmp::Ordering::Greater => Some(doc! { "$gt": i64::MAX - whole }),
                    std::cmp::Ordering::Less => Some(doc! { "$lt": i64::MIN - whole }),
                    std::cmp::Ordering::Equal => None,
                };
                if let Some(beyond) = beyond {
                    let mut overflowing = doc! { "$type": ["int", "long"] };
                    overflowing.extend(beyond);
                    number.insert("$not", overflowing);
                }
                doc! { "$or": [
                    { path.clone(): { "$exists": false } },
                    { path.clone(): number },
                ] }
            })
            .collect()
    }

    /// The first increment that cannot be added to what `doc` holds, with the reason: the sum
    /// overflows a 64-bit integer, or the stored value is not a number.
    pub(crate) fn problem_on(&self, doc: &Document) -> Option<(&str, &Bson, String)> {
        self.by.iter().find_map(|(path, amount)| {
            let current = get_path(doc, path).cloned().unwrap_or(Bson::Int32(0));
            sum_problem(&current, amount).map(|reason| (path.as_str(), amount, reason))
        })
    }

    /// The adjustment that undoes this one.
    pub fn negated(&self) -> Option<Adjust> {
        let by = self
            .by
            .iter()
            .map(|(path, amount)| negate(amount).map(|n| (path.clone(), n)))
            .collect::<Option<Vec<_>>>()?;
        Some(Adjust { by })
    }
}

/// Why a path is unusable, if it is.
pub(crate) fn path_problem(path: &str) -> Option<&'static str> {
    if path.is_empty() {
        return Some("the path is empty");
    }
    if path.split('.').any(str::is_empty) {
        return Some("the path has an empty component");
    }
    if path.split('.').any(|c| c.starts_with('$')) {
        return Some("path components cannot start with '$'");
    }
    if path
        .split('.')
        .any(|c| c.bytes().all(|b| b.is_ascii_digit()))
    {
        return Some("array positions cannot be addressed");
    }
    if path.contains('\0') {
        return Some("the path contains a NUL character");
    }
    None
}

/// Finds two paths where one equals or contains the other (MongoDB rejects such updates).
pub(crate) fn overlapping<'a>(paths: &[&'a str]) -> Option<(&'a str, &'a str)> {
    for (i, a) in paths.iter().enumerate() {
        for b in &paths[i + 1..] {
            if a == b || is_prefix(a, b) || is_prefix(b, a) {
                return Some((a, b));
            }
        }
    }
    None
}

fn is_prefix(parent: &str, child: &str) -> bool {
    child.len() > parent.len()
        && child.starts_with(parent)
        && child.as_bytes()[parent.len()] == b'.'
}

/// Whether an increment amount is acceptable, and if not, why.
pub(crate) fn increment_problem(amount: &Bson) -> Option<&'static str> {
    match amount {
        Bson::Int32(_) | Bson::Int64(_) => None,
        Bson::Double(d) if d.is_finite() => None,
        Bson::Double(_) => Some("the amount is not a finite number"),
        Bson::Decimal128(_) => Some("decimal increments are not supported"),
        _ => Some("the amount is not a number"),
    }
}

/// The value at a dotted path, if present.
pub fn get_path<'a>(doc: &'a Document, path: &str) -> Option<&'a Bson> {
    let mut parts = path.split('.');
    let first = parts.next()?;
    let mut current = doc.get(first)?;
    for part in parts {
        current = match current {
            Bson::Document(inner) => inner.get(part)?,
            _ => return None,
        };
    }
    Some(current)
}

/// Sets the value at a dotted path, creating embedded documents on the way.
pub(crate) fn set_path(doc: &mut Document, path: &str, value: Bson) -> Result<(), String> {
    match path.split_once('.') {
        None => {
            doc.insert(path, value);
            Ok(())
        }
        Some((head, rest)) => {
            let entry = doc
                .entry(head.to_string())
                .or_insert_with(|| Bson::Document(Document::new()));
            match entry {
                Bson::Document(inner) => set_path(inner, rest, value),
                _ => Err(format!("`{head}` is not an embedded document")),
            }
        }
    }
}

/// Removes the value at a dotted path; a missing path is not an error (as in MongoDB).
pub(crate) fn unset_path(doc: &mut Document, path: &str) {
    match path.split_once('.') {
        None => {
            doc.remove(path);
        }
        Some((head, rest)) => {
            if let Some(Bson::Document(inner)) = doc.get_mut(head) {
                unset_path(inner, rest);
            }
        }
    }
}

/// Adds `amount` to the number at a dotted path (a missing field starts from zero).
pub(crate) fn increment_path(doc: &mut Document, path: &str, amount: &Bson) -> Result<(), String> {
    let current = get_path(doc, path).cloned().unwrap_or(Bson::Int32(0));
    let sum =
        add(&current, amount).ok_or_else(|| sum_problem(&current, amount).unwrap_or_default())?;
    set_path(doc, path, sum)
}

/// Why `amount` cannot be added to `current`, if it cannot.
fn sum_problem(current: &Bson, amount: &Bson) -> Option<String> {
    if add(current, amount).is_some() {
        return None;
    }
    Some(if as_f64(current).is_some() {
        format!("adding {amount} to the stored {current} overflows a 64-bit integer")
    } else {
        format!("the stored value {current} is not a number")
    })
}

/// Numeric addition with MongoDB's type promotion (int → long on overflow, anything → double).
pub(crate) fn add(a: &Bson, b: &Bson) -> Option<Bson> {
    match (a, b) {
        (Bson::Int32(x), Bson::Int32(y)) => Some(
            x.checked_add(*y)
                .map(Bson::Int32)
                .unwrap_or_else(|| Bson::Int64(i64::from(*x) + i64::from(*y))),
        ),
        (Bson::Int32(x), Bson::Int64(y)) => i64::from(*x).checked_add(*y).map(Bson::Int64),
        (Bson::Int64(x), Bson::Int32(y)) => x.checked_add(i64::from(*y)).map(Bson::Int64),
        (Bson::Int64(x), Bson::Int64(y)) => x.checked_add(*y).map(Bson::Int64),
        _ => Some(Bson::Double(as_f64(a)? + as_f64(b)?)),
    }
}

fn as_f64(v: &Bson) -> Option<f64> {
    match v {
        Bson::Int32(x) => Some(f64::from(*x)),
        Bson::Int64(x) => Some(*x as f64),
        Bson::Double(x) => Some(*x),
        _ => None,
    }
}

fn negate(v: &Bson) -> Option<Bson> {
    match v {
        Bson::Int32(x) => Some(
            x.checked_neg()
                .map(Bson::Int32)
                .unwrap_or_else(|| Bson::Int64(-i64::from(*x))),
        ),
        Bson::Int64(x) => x.checked_neg().map(Bson::Int64),
        Bson::Double(x) => Some(Bson::Double(-x)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    #[test]
    fn paths_are_checked() {
        assert_eq!(path_problem("a.b"), None);
        assert!(path_problem("").is_some());
        assert!(path_problem("a..b").is_some());
        assert!(path_problem("a.$b").is_some());
        assert!(path_problem("tags.0").is_some());
    }

    #[test]
    fn overlapping_paths_are_found() {
        assert_eq!(overlapping(&["a", "b", "a.c"]), Some(("a", "a.c")));
        assert_eq!(overlapping(&["ab", "a.b"]), None);
        assert_eq!(overlapping(&["x", "x"]), Some(("x", "x")));
    }

    #[test]
    fn nested_paths_set_unset_increment() {
        let mut d = doc! { "a": { "b": 1 } };
        set_path(&mut d, "a.c", Bson::from("x")).unwrap();
        set_path(&mut d, "n.m", Bson::Int64(2)).unwrap();
        increment_path(&mut d, "a.b", &Bson::Int32(4)).unwrap();
        increment_path(&mut d, "z", &Bson::Double(0.5)).unwrap();
        unset_path(&mut d, "a.c");
        assert_eq!(d, doc! { "a": { "b": 5 }, "n": { "m": 2_i64 }, "z": 0.5 });
        assert!(set_path(&mut d, "z.q", Bson::Int32(1)).is_err());
    }

    #[test]
    fn addition_promotes_like_mongodb() {
        assert_eq!(
            add(&Bson::Int32(i32::MAX), &Bson::Int32(1)),
            Some(Bson::Int64(i64::from(i32::MAX) + 1))
        );
        assert_eq!(add(&Bson::Int64(1), &Bson::Int32(1)), Some(Bson::Int64(2)));
        assert_eq!(
            add(&Bson::Int64(1), &Bson::Double(0.5)),
            Some(Bson::Double(1.5))
        );
        assert_eq!(add(&Bson::Int64(i64::MAX), &Bson::Int64(1)), None);
        assert_eq!(add(&Bson::String("a".into()), &Bson::Int32(1)), None);
    }

    #[test]
    fn negation_reverses_adjustments() {
        let adj = Adjust::new().by("a", 3_i32).by("b", -2.5).by("c", i32::MIN);
        let neg = adj.negated().unwrap();
        assert_eq!(
            neg.by,
            vec![
                ("a".to_string(), Bson::Int32(-3)),
                ("b".to_string(), Bson::Double(2.5)),
                ("c".to_string(), Bson::Int64(-i64::from(i32::MIN))),
            ]
        );
        assert!(Adjust::new().by("x", i64::MIN).negated().is_none());
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// Dotted paths of one to four components, letters only (so always usable).
        fn path() -> impl Strategy<Value = String> {
            prop::collection::vec("[a-z]{1,3}", 1..5).prop_map(|parts| parts.join("."))
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            /// A usable path set on a document reads back the value set; unset, it reads as
            /// nothing; the other paths set before keep their values unless one contains the
            /// other.
            #[test]
            fn set_then_get_and_unset_agree(paths in prop::collection::vec(path(), 1..6), v in any::<i64>()) {
                let mut doc = Document::new();
                let mut kept: Vec<&str> = Vec::new();
                for (i, p) in paths.iter().enumerate() {
                    prop_assert_eq!(path_problem(p), None);
                    if kept.iter().any(|k| *k == p.as_str() || is_prefix(k, p) || is_prefix(p, k)) {
                        continue;
                    }
                    set_path(&mut doc, p, Bson::Int64(v.wrapping_add(i as i64))).expect("set");
                    kept.push(p);
                }
                for (i, p) in paths.iter().enumerate() {
                    if kept.contains(&p.as_str()) && paths.iter().position(|q| q == p) == Some(i) {
                        prop_assert_eq!(get_path(&doc, p), Some(&Bson::Int64(v.wrapping_add(i as i64))));
                    }
                }
                let first = kept[0];
                unset_path(&mut doc, first);
                prop_assert_eq!(get_path(&doc, first), None);
                prop_assert_eq!(overlapping(&kept), None);
            }

            /// Paths that contain one another always overlap; a path with an empty, `$` or
            /// all-digit component is never usable.
            #[test]
            fn overlaps_and_unusable_paths_are_found(p in path(), q in "[a-z]{1,3}", bad in 0..4_usize) {
                let child = format!("{p}.{q}");
                prop_assert!(overlapping(&[&p, &child]).is_some());
                prop_assert!(overlapping(&[&child, &p]).is_some());
                prop_assert!(overlapping(&[&p, &p]).is_some());
                let unusable = match bad {
                    0 => format!("{p}..{q}"),
                    1 => format!("{p}.${q}"),
                    2 => format!("{p}.0"),
                    _ => format!(".{p}"),
                };
                prop_assert!(path_problem(&unusable).is_some(), "{}", unusable);
            }

            /// Adding 64-bit integers is exact or refused (never wraps), and an adjust followed
            /// by its negation leaves the number where it was.
            #[test]
            fn increments_never_wrap_and_negation_undoes_them(a in any::<i64>(), b in any::<i64>(), p in path()) {
                let exact = i128::from(a) + i128::from(b);
                match add(&Bson::Int64(a), &Bson::Int64(b)) {
                    Some(Bson::Int64(sum)) => prop_assert_eq!(i128::from(sum), exact),
                    None => prop_assert!(i64::try_from(exact).is_err()),
                    other => prop_assert!(false, "{:?}", other),
                }
                let mut doc = Document::new();
                set_path(&mut doc, &p, Bson::Int64(a)).expect("set");
                let adjust = Adjust::new().by(p.clone(), b);
                if adjust.apply_to(&mut doc).is_ok() {
                    let back = adjust.negated();
                    if let Some(back) = back.filter(|n| n.apply_to(&mut doc).is_ok()) {
                        let _ = back;
                        prop_assert_eq!(get_path(&doc, &p), Some(&Bson::Int64(a)));
                    }
                } else {
                    prop_assert!(i64::try_from(exact).is_err(), "{} + {} refused", a, b);
                }
            }
        }
    }
}
