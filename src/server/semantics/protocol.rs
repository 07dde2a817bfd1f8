//! The behaviours the transaction protocol relies on beyond single-document atomicity
//! (`$$NOW`, pipeline updates and upserts, `_id` equality across number types), and the ones that
//! cost a feature or fidelity when lacking (comparison order, index and error shapes, validators).

use bson::{doc, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};

use super::{fail, outcome, Check, Checked, Fault, Semantic, Unasked};
use crate::server::codes::{error_code, DUPLICATE_KEY, VALIDATION_FAILED};

const EXPR_NOW: Check = Check {
    name: "expr_now",
    what: "$expr and $$NOW in query filters, by which every deadline is decided",
    needed: true,
    fallback: None,
};
const PIPELINE_UPDATES: Check = Check {
    name: "pipeline_updates",
    what: "updates given as an aggregation pipeline, with $$NOW, as from MongoDB 4.2",
    needed: true,
    fallback: None,
};
const UPSERT_SEEDING: Check = Check {
    name: "upsert_seeding",
    what: "a pipeline upsert starts from the filter's _id and top-level equalities",
    needed: true,
    fallback: None,
};
const UPSERT_SEEDING_PATHS: Check = Check {
    name: "upsert_seeding_paths",
    what: "an upsert also takes equalities on dotted paths and inside $and",
    needed: false,
    fallback: Some("none needed: mongotx's own upserts filter on `_id` and top-level fields only"),
};
const STATEMENT_NOW: Check = Check {
    name: "statement_now",
    what: "one $$NOW for a whole statement, across its pipeline's stages",
    needed: true,
    fallback: None,
};
const NUMERIC_IDS: Check = Check {
    name: "numeric_ids",
    what: "Int32 7, Int64 7 and Double 7.0 are one _id",
    needed: true,
    fallback: None,
};
const PIPELINE_FIND_AND_MODIFY: Check = Check {
    name: "pipeline_find_and_modify",
    what: "findAndModify with a pipeline update and upsert, returning the new document",
    needed: true,
    fallback: None,
};
const MISSING_BELOW_NULL: Check = Check {
    name: "missing_below_null",
    what: "in expressions a missing field is below null and not equal to it",
    needed: false,
    fallback: Some(
        "none: a query that compares a field with null in `$expr` answers as this server orders them",
    ),
};
const BINARY_STRINGS: Check = Check {
    name: "binary_string_order",
    what: "strings sort by their UTF-8 bytes",
    needed: false,
    fallback: Some(
        "none: sorts and ranges on strings answer in this server's order, not MongoDB's",
    ),
};
const UNIQUE_MISSING: Check = Check {
    name: "unique_missing_as_null",
    what: "a unique index takes a missing field as null",
    needed: false,
    fallback: Some(
        "none needed: mongotx's own indexes are sparse; a service's unique index on an optional field behaves as this server says",
    ),
};
const INC_OVERFLOW: Check = Check {
    name: "inc_overflow_refused",
    what: "$inc past the 64-bit range fails instead of wrapping around",
    needed: false,
    fallback: Some(
        "none: an increment past the 64-bit range is not refused by the server, so keep counters far from it",
    ),
};
const STATEMENT_ERRORS: Check = Check {
    name: "per_statement_errors",
    what: "an unordered update reports each statement's error and runs the others",
    needed: false,
    fallback: Some(
        "adoption reads a batch's unstamped documents again and retries them (slower, same result)",
    ),
};
const DUPLICATE_KEY_SHAPE: Check = Check {
    name: "duplicate_key_shape",
    what: "a duplicate-key error names its index, with keyPattern and keyValue",
    needed: false,
    fallback: Some("none needed: mongotx knows a duplicate by its code (11000) alone"),
};
const VALIDATION: Check = Check {
    name: "json_schema_validation",
    what: "$jsonSchema collection validators enforced, refusing with code 121",
    needed: false,
    fallback: Some(
        "mongotx checks documents against their schema on the client before each of its writes; other writers go unchecked",
    ),
};
const VALIDATION_DETAILS: Check = Check {
    name: "validation_details",
    what: "a validation failure names the rule and property in errInfo.details, as from 5.0",
    needed: false,
    fallback: Some(
        "mongotx explains a refusal by checking the document against the schema on the client",
    ),
};
const LET: Check = Check {
    name: "let_variables",
    what: "let variables on update and find, as from 5.0",
    needed: false,
    fallback: Some(
        "none needed: mongotx sends values inline (`$literal`), never as `let` variables",
    ),
};

/// A stage that keeps the server busy for a moment between two readings of `$$NOW`. The needed
/// checks use the stages mongotx itself sends (`$addFields`, `$replaceRoot`), not their 4.2
/// aliases.
fn spin() -> Document {
    doc! { "$addFields": { "_spin": { "$size": { "$range": [0, 100_000] } } } }
}

async fn expr_now(coll: &Collection<Document>) -> Checked {
    coll.insert_one(doc! { "_id": "expr", "d": DateTime::from_millis(1_000) })
        .await
        .map_err(fail("insert"))?;
    let found = coll
        .find_one(doc! { "_id": "expr", "$expr": { "$lt": ["$d", "$$NOW"] } })
        .await
        .map_err(fail("a filter comparing a date with $$NOW"))?;
    match found {
        Some(_) => Ok(()),
        None => Err("a date in 1970 was not found to be before $$NOW".into()),
    }
}

async fn pipeline_updates(coll: &Collection<Document>) -> Checked {
    coll.insert_one(doc! { "_id": "pipe", "n": 1 })
        .await
        .map_err(fail("insert"))?;
    let done = coll
        .update_one(
            doc! { "_id": "pipe" },
            vec![doc! { "$addFields": { "at": "$$NOW", "n": { "$add": ["$n", 1] } } }],
        )
        .await
        .map_err(fail("a pipeline update"))?;
    let stored = coll
        .find_one(doc! { "_id": "pipe" })
        .await
        .map_err(fail("read back"))?
        .unwrap_or_default();
    if done.modified_count == 1 && stored.get_datetime("at").is_ok() && stored.get_i32("n") == Ok(2)
    {
        Ok(())
    } else {
        Err(Fault::Lacks(format!("the update left {stored}")))
    }
}

async fn upsert_seeding(coll: &Collection<Document>) -> Checked {
    seeded(
        coll,
        doc! { "_id": "seed", "kind": "k", "e": { "$gt": 5 } },
        doc! { "_id": "seed", "kind": "k", "x": "k" },
        "$kind",
    )
    .await
}

async fn upsert_seeding_paths(coll: &Collection<Document>) -> Checked {
    seeded(
        coll,
        doc! { "_id": "seed2", "a.b": 1, "$and": [{ "c": 2 }], "e": { "$gt": 5 } },
        doc! { "_id": "seed2", "a": { "b": 1 }, "c": 2, "x": 2 },
        "$c",
    )
    .await
}

/// A pipeline upsert on `filter` that sets `x` to `from` must make `expected`.
async fn seeded(
    coll: &Collection<Document>,
    filter: Document,
    expected: Document,
    from: &str,
) -> Checked {
    let id = filter.get("_id").cloned().unwrap_or(Bson::Null);
    coll.update_one(filter, vec![doc! { "$addFields": { "x": from } }])
        .upsert(true)
        .await
        .map_err(fail("a pipeline upsert"))?;
    let stored = coll
        .find_one(doc! { "_id": id })
        .await
        .map_err(fail("read back"))?
        .unwrap_or_default();
    if stored == expected {
        Ok(())
    } else {
        Err(Fault::Lacks(format!(
            "the upsert made {stored}, not {expected}"
        )))
    }
}

async fn statement_now(coll: &Collection<Document>) -> Checked {
    coll.insert_one(doc! { "_id": "now" })
        .await
        .map_err(fail("insert"))?;
    coll.update_one(
        doc! { "_id": "now" },
        vec![
            doc! { "$addFields": { "a": "$$NOW" } },
            spin(),
            doc! { "$addFields": { "b": "$$NOW" } },
            doc! { "$unset": "_spin" },
        ],
    )
    .await
    .map_err(fail("a pipeline reading $$NOW twice"))?;
    let stored = coll
        .find_one(doc! { "_id": "now" })
        .await
        .map_err(fail("read back"))?
        .unwrap_or_default();
    match (stored.get_datetime("a"), stored.get_datetime("b")) {
        (Ok(a), Ok(b)) if a == b => Ok(()),
        _ => Err(Fault::Lacks(format!(
            "two stages of one update read {stored}"
        ))),
    }
}

async fn numeric_ids(coll: &Collection<Document>) -> Checked {
    coll.insert_one(doc! { "_id": 7_i32 })
        .await
        .map_err(fail("insert"))?;
    let found = coll
        .find_one(doc! { "_id": 7.0 })
        .await
        .map_err(fail("find"))?;
    if found.is_none() {
        return Err("_id 7.0 did not find _id 7".into());
    }
    match coll.insert_one(doc! { "_id": 7_i64 }).await {
        Err(e) if error_code(&e) == Some(DUPLICATE_KEY) => Ok(()),
        Err(e) => Err(Fault::Lacks(format!(
            "inserting _id 7 (Int64) failed otherwise: {e}"
        ))),
        Ok(_) => Err("_id 7 (Int64) was inserted beside _id 7 (Int32)".into()),
    }
}

async fn pipeline_find_and_modify(coll: &Collection<Document>) -> Checked {
    let made = coll
        .find_one_and_update(
            doc! { "_id": "fam", "kind": "k" },
            vec![doc! { "$addFields": { "n": { "$add": [{ "$ifNull": ["$n", 0] }, 1] } } }],
        )
        .upsert(true)
        .return_document(ReturnDocument::After)
        .await
        .map_err(fail("findAndModify with a pipeline"))?;
    match made {
        Some(d) if d == doc! { "_id": "fam", "kind": "k", "n": 1 } => Ok(()),
        other => Err(Fault::Lacks(format!("it returned {other:?}"))),
    }
}

async fn ids(
    coll: &Collection<Document>,
    filter: Document,
    sort: Document,
) -> Result<Vec<Bson>, Fault> {
    let found: Vec<Document> = coll
        .find(filter)
        .sort(sort)
        .await
        .map_err(fail("find"))?
        .try_collect()
        .await
        .map_err(fail("find"))?;
    Ok(found
        .into_iter()
        .map(|d| d.get("_id").cloned().unwrap_or(Bson::Null))
        .collect())
}

async fn missing_below_null(db: &Database, name: &str) -> Checked {
    let coll: Collection<Document> = db.collection(&format!("{name}_nulls"));
    coll.insert_many([doc! { "_id": 1 }, doc! { "_id": 2, "a": Bson::Null }])
        .await
        .map_err(fail("insert"))?;
    let equal = ids(
        &coll,
        doc! { "$expr": { "$eq": ["$a", Bson::Null] } },
        doc! { "_id": 1 },
    )
    .await?;
    let below = ids(
        &coll,
        doc! { "$expr": { "$lt": ["$a", Bson::Null] } },
        doc! { "_id": 1 },
    )
    .await?;
    let _ = coll.drop().await;
    if equal == vec![Bson::Int32(2)] && below == vec![Bson::Int32(1)] {
        Ok(())
    } else {
        Err(Fault::Lacks(format!(
            "$eq null matched {equal:?}, $lt null matched {below:?} (expected [2] and [1])"
        )))
    }
}

async fn binary_strings(db: &Database, name: &str) -> Checked {
    let coll: Collection<Document> = db.collection(&format!("{name}_strings"));
    coll.insert_many([
        doc! { "_id": 1, "s": "\u{1f600}" },
        doc! { "_id": 2, "s": "\u{ff61}" },
    ])
    .await
    .map_err(fail("insert"))?;
    let sorted = ids(&coll, doc! {}, doc! { "s": 1 }).await?;
    let _ = coll.drop().await;
    if sorted == vec![Bson::Int32(2), Bson::Int32(1)] {
        Ok(())
    } else {
        Err("U+1F600 sorted before U+FF61 (UTF-16 order, not UTF-8 bytes)".into())
    }
}

async fn unique_missing(db: &Database, name: &str) -> Checked {
    let coll: Collection<Document> = db.collection(&format!("{name}_unique"));
    db.run_command(doc! {
        "createIndexes": coll.name(),
        "indexes": [{ "key": { "u": 1 }, "name": "u_1", "unique": true }],
    })
    .await
    .map_err(fail("create a unique index"))?;
    coll.insert_one(doc! { "_id": 1 })
        .await
        .map_err(fail("insert"))?;
    let second = coll.insert_one(doc! { "_id": 2 }).await;
    let _ = coll.drop().await;
    match second {
        Err(e) if error_code(&e) == Some(DUPLICATE_KEY) => Ok(()),
        Err(e) => Err(Fault::Lacks(format!(
            "the second document without u failed otherwise: {e}"
        ))),
        Ok(_) => Err("two documents without the indexed field were both stored".into()),
    }
}

async fn inc_overflow(coll: &Collection<Document>) -> Checked {
    coll.insert_one(doc! { "_id": "inc", "n": i64::MAX })
        .await
        .map_err(fail("insert"))?;
    let done = coll
        .update_one(doc! { "_id": "inc" }, doc! { "$inc": { "n": 1_i64 } })
        .await;
    match done {
        // Refused by the server, as MongoDB refuses it; a lost connection says nothing.
        Err(e) => match fail("$inc")(e) {
            Fault::Lacks(_) => Ok(()),
            unreachable => Err(unreachable),
        },
        Ok(_) => {
            let stored = coll
                .find_one(doc! { "_id": "inc" })
                .await
                .map_err(fail("read back"))?
                .unwrap_or_default();
            Err(Fault::Lacks(format!(
                "$inc of the largest Int64 succeeded: {stored}"
            )))
        }
    }
}

async fn statement_errors(db: &Database, coll: &Collection<Document>) -> Checked {
    coll.insert_many([doc! { "_id": "st1", "n": 1 }, doc! { "_id": "st2", "n": 2 }])
        .await
        .map_err(fail("insert"))?;
    let reply = db
        .run_command(doc! {
            "update": coll.name(),
            "ordered": false,
            "updates": [
                { "q": { "_id": "st1" }, "u": [{ "$set": { "n": { "$divide": ["$n", 0] } } }] },
                { "q": { "_id": "st2" }, "u": { "$inc": { "n": 1 } } },
            ],
        })
        .await
        .map_err(fail("an unordered update whose first statement fails"))?;
    let indexes: Vec<i32> = reply
        .get_array("writeErrors")
        .map(|errors| {
            errors
                .iter()
                .filter_map(|e| e.as_document()?.get_i32("index").ok())
                .collect()
        })
        .unwrap_or_default();
    let modified = reply.get_i32("nModified").unwrap_or(-1);
    if indexes == vec![0] && modified == 1 {
        Ok(())
    } else {
        Err(Fault::Lacks(format!("the reply was {reply}")))
    }
}

async fn duplicate_key_shape(db: &Database, coll: &Collection<Document>) -> Checked {
    coll.insert_one(doc! { "_id": "dupshape" })
        .await
        .map_err(fail("insert"))?;
    let reply = db
        .run_command(doc! { "insert": coll.name(), "documents": [{ "_id": "dupshape" }] })
        .await
        .map_err(fail("a duplicate insert"))?;
    let error = reply
        .get_array("writeErrors")
        .ok()
        .and_then(|errors| errors.first()?.as_document().cloned())
        .unwrap_or_default();
    let names_index = error
        .get_str("errmsg")
        .unwrap_or("")
        .contains("index: _id_");
    if error.get_i32("code") == Ok(DUPLICATE_KEY)
        && names_index
        && error.get_document("keyPattern") == Ok(&doc! { "_id": 1 })
        && error.get_document("keyValue") == Ok(&doc! { "_id": "dupshape" })
    {
        Ok(())
    } else {
        Err(Fault::Lacks(format!("the write error was {error}")))
    }
}

/// Validators not enforced (`fault`): their failures' details cannot be judged then.
fn unvalidated(fault: Fault) -> (Checked, Checked) {
    match fault {
        Fault::Unreachable(e) => (
            Err(Fault::Unreachable(e.clone())),
            Err(Fault::Unreachable(e)),
        ),
        fault => (
            Err(fault),
            Err(Fault::NotApplicable(
                "validators are not enforced, so no failure can be examined".to_string(),
            )),
        ),
    }
}

/// Validation enforced, and explained: `(enforced, explained)`.
async fn validation(db: &Database, name: &str) -> (Checked, Checked) {
    let collection = format!("{name}_validated");
    let created = db
        .run_command(doc! {
            "create": &collection,
            "validator": { "$jsonSchema": {
                "bsonType": "object",
                "required": ["must"],
                "properties": { "must": { "bsonType": "string" } },
            } },
        })
        .await;
    if let Err(e) = created {
        return unvalidated(fail("creating a collection with a validator")(e));
    }
    let reply = db
        .run_command(doc! { "insert": &collection, "documents": [{ "_id": 1, "must": 5 }] })
        .await;
    let _ = db.collection::<Document>(&collection).drop().await;
    let error = match reply {
        Ok(reply) => reply
            .get_array("writeErrors")
            .ok()
            .and_then(|errors| errors.first()?.as_document().cloned()),
        Err(e) => return unvalidated(fail("an insert breaking the validator")(e)),
    };
    let Some(error) = error.filter(|e| e.get_i32("code") == Ok(VALIDATION_FAILED)) else {
        return unvalidated("a document breaking the validator was stored".into());
    };
    let names = error
        .get_document("errInfo")
        .and_then(|i| i.get_document("details"))
        .map(|d| d.to_string())
        .unwrap_or_default();
    let explained = if names.contains("$jsonSchema") && names.contains("must") {
        Ok(())
    } else {
        Err("the refusal carries no details (servers before 5.0 give none)".into())
    };
    (Ok(()), explained)
}

async fn let_variables(db: &Database, coll: &Collection<Document>) -> Checked {
    coll.insert_one(doc! { "_id": "let", "n": 2 })
        .await
        .map_err(fail("insert"))?;
    let reply = db
        .run_command(doc! {
            "update": coll.name(),
            "updates": [{ "q": { "_id": "let", "$expr": { "$eq": ["$n", "$$two"] } }, "u": [{ "$set": { "m": "$$two" } }] }],
            "let": { "two": 2 },
        })
        .await
        .map_err(fail("an update with let"))?;
    if reply.get_i32("nModified") == Ok(1) {
        Ok(())
    } else {
        Err(Fault::Lacks(format!("the update replied {reply}")))
    }
}

/// The needed checks, in the scratch collection `coll`.
pub(super) async fn needed(coll: &Collection<Document>) -> Result<Vec<Semantic>, Unasked> {
    Ok(vec![
        outcome(&EXPR_NOW, expr_now(coll).await)?,
        outcome(&PIPELINE_UPDATES, pipeline_updates(coll).await)?,
        outcome(&UPSERT_SEEDING, upsert_seeding(coll).await)?,
        outcome(&STATEMENT_NOW, statement_now(coll).await)?,
        outcome(&NUMERIC_IDS, numeric_ids(coll).await)?,
        outcome(
            &PIPELINE_FIND_AND_MODIFY,
            pipeline_find_and_modify(coll).await,
        )?,
    ])
}

/// The checks mongotx can do without, in `coll` and collections named after `name` beside it.
pub(super) async fn optional(
    db: &Database,
    name: &str,
    coll: &Collection<Document>,
) -> Result<Vec<Semantic>, Unasked> {
    let (validated, explained) = validation(db, name).await;
    Ok(vec![
        outcome(&UPSERT_SEEDING_PATHS, upsert_seeding_paths(coll).await)?,
        outcome(&MISSING_BELOW_NULL, missing_below_null(db, name).await)?,
        outcome(&BINARY_STRINGS, binary_strings(db, name).await)?,
        outcome(&UNIQUE_MISSING, unique_missing(db, name).await)?,
        outcome(&INC_OVERFLOW, inc_overflow(coll).await)?,
        outcome(&STATEMENT_ERRORS, statement_errors(db, coll).await)?,
        outcome(&DUPLICATE_KEY_SHAPE, duplicate_key_shape(db, coll).await)?,
        outcome(&VALIDATION, validated)?,
        outcome(&VALIDATION_DETAILS, explained)?,
        outcome(&LET, let_variables(db, coll).await)?,
    ])
}
