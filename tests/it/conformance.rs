//! The server behaviours mongotx's correctness rests on, one test each, every expectation taken
//! from the MongoDB manual page cited beside it. The suite runs against whatever server the tests
//! use, so it checks a user's own deployment too:
//!
//! ```sh
//! MONGODB_URI=mongodb://host:27017/ cargo test --test it conformance::
//! ```
//!
//! Where MongoDB changed between versions, a test asks the server which version it is and expects
//! that version's behaviour (the local test server plays 8.0, or 4.4 with `--no-bulk-write`, which
//! `MONGOTX_TEST_SERVER_ARGS=--no-bulk-write` gives the harness). Nothing is skipped: a behaviour a
//! version lacks is asserted to be absent.

use std::collections::BTreeSet;

use crate::common::TestDb;
use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::future::join_all;
use futures::TryStreamExt;
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// The server's version as (major, minor), from `buildInfo`.
async fn version(db: &Database) -> (i32, i32) {
    let info = db
        .run_command(doc! { "buildInfo": 1 })
        .await
        .expect("buildInfo");
    let parts: Vec<i32> = info
        .get_array("versionArray")
        .expect("buildInfo.versionArray")
        .iter()
        .filter_map(|v| v.as_i32().or_else(|| v.as_i64().map(|n| n as i32)))
        .collect();
    (parts[0], parts.get(1).copied().unwrap_or(0))
}

/// Runs a command that must succeed (ok: 1), returning its reply.
async fn command(db: &Database, cmd: Document) -> Document {
    let shown = cmd.to_string();
    db.run_command(cmd)
        .await
        .unwrap_or_else(|e| panic!("command {shown} failed: {e}"))
}

/// The code of a command's error, which must fail.
async fn command_error_code(db: &Database, cmd: Document) -> i32 {
    let shown = cmd.to_string();
    match db.run_command(cmd).await {
        Ok(reply) => panic!("command {shown} should fail, replied {reply}"),
        Err(e) => code_of(&e).unwrap_or_else(|| panic!("command {shown}: no server code in {e}")),
    }
}

fn code_of(e: &mongodb::error::Error) -> Option<i32> {
    use mongodb::error::{ErrorKind, WriteFailure};
    match e.kind.as_ref() {
        ErrorKind::Command(c) => Some(c.code),
        ErrorKind::Write(WriteFailure::WriteError(w)) => Some(w.code),
        _ => None,
    }
}

/// The write errors of a write command's reply (empty when there are none).
fn write_errors(reply: &Document) -> Vec<Document> {
    reply
        .get_array("writeErrors")
        .map(|errors| {
            errors
                .iter()
                .filter_map(|e| e.as_document().cloned())
                .collect()
        })
        .unwrap_or_default()
}

fn int(doc: &Document, key: &str) -> i64 {
    match doc.get(key) {
        Some(Bson::Int32(n)) => i64::from(*n),
        Some(Bson::Int64(n)) => *n,
        Some(Bson::Double(n)) => *n as i64,
        other => panic!("{key} is not a number in {doc}: {other:?}"),
    }
}

/// Every document of a collection, sorted by `_id`.
async fn all(coll: &Collection<Document>) -> Vec<Document> {
    coll.find(doc! {})
        .sort(doc! { "_id": 1 })
        .await
        .expect("find")
        .try_collect()
        .await
        .expect("collect")
}

/// The `_id`s a filter matches, in the order of `sort`.
async fn ids(coll: &Collection<Document>, filter: Document, sort: Document) -> Vec<Bson> {
    coll.find(filter)
        .sort(sort)
        .await
        .expect("find")
        .try_collect::<Vec<Document>>()
        .await
        .expect("collect")
        .into_iter()
        .map(|d| d.get("_id").cloned().unwrap_or(Bson::Null))
        .collect()
}

/// Asserts that `filter` matches exactly the documents with the `_id`s `expected`, sorted by `_id`.
async fn assert_matches(coll: &Collection<Document>, filter: Document, expected: &[i32]) {
    let shown = filter.to_string();
    let found = ids(coll, filter, doc! { "_id": 1 }).await;
    let expected: Vec<Bson> = expected.iter().map(|i| Bson::Int32(*i)).collect();
    assert_eq!(found, expected, "{shown}");
}

/// Creates `name` with `validator` (and any extra options) and returns it.
async fn with_validator(db: &Database, name: &str, options: Document) -> Collection<Document> {
    let mut create = doc! { "create": name };
    create.extend(options);
    command(db, create).await;
    db.collection(name)
}

/// The reply of a raw `insert` of one document.
async fn insert_raw(db: &Database, coll: &str, document: Document) -> Document {
    command(
        db,
        doc! { "insert": coll, "documents": [document], "ordered": true },
    )
    .await
}

/// Whether inserting `document` is refused by the validator (code 121); any other error fails.
async fn refused_by_validator(db: &Database, coll: &str, document: Document) -> bool {
    let reply = insert_raw(db, coll, document.clone()).await;
    match write_errors(&reply).first() {
        None => false,
        Some(error) if int(error, "code") == 121 => true,
        Some(error) => panic!("inserting {document} failed otherwise: {error}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Schema validation
// ---------------------------------------------------------------------------------------------

fn account_schema() -> Document {
    doc! { "$jsonSchema": {
        "bsonType": "object",
        "required": ["owner", "balance"],
        "properties": {
            "owner": { "bsonType": "string" },
            "balance": { "bsonType": "long", "minimum": 0 },
        },
    } }
}

/// https://www.mongodb.com/docs/manual/core/schema-validation/specify-json-schema/ : a document
/// that does not match the collection's `$jsonSchema` is refused with code 121
/// (DocumentValidationFailure), one that does is stored.
#[tokio::test]
async fn a_json_schema_validator_refuses_an_invalid_insert_with_code_121() {
    let t = TestDb::unprobed().await;
    let coll = with_validator(&t.db, "acc", doc! { "validator": account_schema() }).await;
    let reply = insert_raw(
        &t.db,
        "acc",
        doc! { "_id": 1, "owner": "ann", "balance": "lots" },
    )
    .await;
    let errors = write_errors(&reply);
    assert_eq!(errors.len(), 1, "{reply}");
    assert_eq!(int(&errors[0], "code"), 121, "{reply}");
    assert_eq!(int(&reply, "n"), 0, "{reply}");
    let reply = insert_raw(
        &t.db,
        "acc",
        doc! { "_id": 2, "owner": "bob", "balance": 5_i64 },
    )
    .await;
    assert!(write_errors(&reply).is_empty(), "{reply}");
    assert_eq!(all(&coll).await.len(), 1);
}

/// https://www.mongodb.com/docs/manual/core/schema-validation/handle-invalid-documents/ and the
/// 5.0 release notes ("Improved error messages for schema validation"): from 5.0 a refusal carries
/// `errInfo` with the failing document's `_id` and `details` naming each rule that failed
/// (`operatorName`), the property (`propertiesNotSatisfied[].propertyName`) and the missing
/// required fields; 4.4 carries no details.
#[tokio::test]
async fn a_validation_failure_names_the_rule_and_the_property() {
    let t = TestDb::unprobed().await;
    with_validator(&t.db, "acc", doc! { "validator": account_schema() }).await;
    let reply = insert_raw(&t.db, "acc", doc! { "_id": 7, "balance": "lots" }).await;
    let error = write_errors(&reply).first().cloned().expect("refused");
    assert_eq!(int(&error, "code"), 121);
    let details = error
        .get_document("errInfo")
        .ok()
        .and_then(|info| info.get_document("details").ok());
    if version(&t.db).await < (5, 0) {
        assert!(
            details.is_none(),
            "4.4 explains no validation failure: {error}"
        );
        return;
    }
    let info = error.get_document("errInfo").expect("errInfo");
    assert_eq!(
        info.get("failingDocumentId"),
        Some(&Bson::Int32(7)),
        "{info}"
    );
    let details = details.expect("errInfo.details");
    assert_eq!(details.get_str("operatorName").ok(), Some("$jsonSchema"));
    let rules: Vec<&Document> = details
        .get_array("schemaRulesNotSatisfied")
        .expect("schemaRulesNotSatisfied")
        .iter()
        .filter_map(Bson::as_document)
        .collect();
    let properties = rules
        .iter()
        .find(|r| r.get_str("operatorName").ok() == Some("properties"))
        .unwrap_or_else(|| panic!("no properties rule in {details}"));
    let property = properties
        .get_array("propertiesNotSatisfied")
        .expect("propertiesNotSatisfied")[0]
        .as_document()
        .expect("a property");
    assert_eq!(property.get_str("propertyName").ok(), Some("balance"));
    let failed = property.get_array("details").expect("details")[0]
        .as_document()
        .expect("a rule");
    assert_eq!(failed.get_str("operatorName").ok(), Some("bsonType"));
    let required = rules
        .iter()
        .find(|r| r.get_str("operatorName").ok() == Some("required"))
        .unwrap_or_else(|| panic!("no required rule in {details}"));
    assert_eq!(
        required
            .get_array("missingProperties")
            .expect("missingProperties"),
        &vec![Bson::from("owner")]
    );
}

/// https://www.mongodb.com/docs/manual/core/schema-validation/ : validation applies to inserts and
/// to updates (by operators, by replacement, by pipeline, through findAndModify, as an upsert, and
/// inside a `bulkWrite`, https://www.mongodb.com/docs/manual/reference/command/bulkWrite/).
#[tokio::test]
async fn the_validator_checks_every_write_path() {
    let t = TestDb::unprobed().await;
    let coll = with_validator(&t.db, "acc", doc! { "validator": account_schema() }).await;
    coll.insert_one(doc! { "_id": 1, "owner": "ann", "balance": 5_i64 })
        .await
        .expect("valid insert");
    let refused = |reply: Document| {
        let errors = write_errors(&reply);
        errors.len() == 1 && int(&errors[0], "code") == 121
    };
    let update = |u: Bson, upsert: bool| {
        doc! { "update": "acc", "updates": [{ "q": { "_id": if upsert { 2 } else { 1 } }, "u": u, "upsert": upsert }] }
    };
    // By operators, by replacement, by pipeline, as an upsert.
    assert!(refused(
        command(
            &t.db,
            update(doc! { "$set": { "balance": -1_i64 } }.into(), false)
        )
        .await
    ));
    assert!(refused(
        command(&t.db, update(doc! { "owner": "ann" }.into(), false)).await
    ));
    let pipeline = vec![Bson::from(doc! { "$set": { "balance": "$owner" } })];
    assert!(refused(
        command(&t.db, update(pipeline.into(), false)).await
    ));
    assert!(refused(
        command(
            &t.db,
            update(doc! { "$set": { "owner": "bo" } }.into(), true)
        )
        .await
    ));
    // findAndModify: a command error with the same code.
    let code = command_error_code(
        &t.db,
        doc! { "findAndModify": "acc", "query": { "_id": 1 }, "update": { "$unset": { "owner": "" } } },
    )
    .await;
    assert_eq!(code, 121);
    // A valid change of each kind still goes through.
    let ok = command(
        &t.db,
        update(doc! { "$inc": { "balance": 1_i64 } }.into(), false),
    )
    .await;
    assert!(write_errors(&ok).is_empty(), "{ok}");
    assert_eq!(
        all(&coll).await,
        vec![doc! { "_id": 1, "owner": "ann", "balance": 6_i64 }]
    );

    // bulkWrite: the refused entry alone fails (8.0+); before 8.0 there is no bulkWrite.
    use mongodb::options::{InsertOneModel, UpdateOneModel, WriteModel};
    let models: Vec<WriteModel> = vec![
        UpdateOneModel::builder()
            .namespace(coll.namespace())
            .filter(doc! { "_id": 1 })
            .update(doc! { "$set": { "balance": "x" } })
            .build()
            .into(),
        InsertOneModel::builder()
            .namespace(coll.namespace())
            .document(doc! { "_id": 3, "owner": "cy", "balance": 1_i64 })
            .build()
            .into(),
    ];
    let outcome = t.client.bulk_write(models).ordered(false).await;
    if version(&t.db).await < (8, 0) {
        assert!(outcome.is_err(), "bulkWrite before 8.0");
        return;
    }
    let e = outcome.expect_err("the first entry is refused");
    let mongodb::error::ErrorKind::BulkWrite(failure) = e.kind.as_ref() else {
        panic!("expected a bulk write error, got {e}");
    };
    assert_eq!(failure.write_errors.len(), 1, "{failure:?}");
    assert_eq!(failure.write_errors.get(&0).map(|w| w.code), Some(121));
    assert_eq!(all(&coll).await.len(), 2, "the valid entry was written");
}

/// https://www.mongodb.com/docs/manual/core/schema-validation/specify-validation-level/ :
/// `moderate` validates inserts and updates of documents that were valid, and lets updates of
/// already invalid documents through; `strict` (the default) validates every update.
#[tokio::test]
async fn validation_level_moderate_lets_updates_of_invalid_documents_through() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("acc");
    coll.insert_many([
        doc! { "_id": 1, "owner": 5, "balance": 1_i64 },
        doc! { "_id": 2, "owner": "bo", "balance": 1_i64 },
    ])
    .await
    .expect("seed before any validator");
    command(
        &t.db,
        doc! { "collMod": "acc", "validator": account_schema(), "validationLevel": "moderate" },
    )
    .await;
    let set = |id: i32, balance: i64| {
        doc! { "update": "acc", "updates": [{ "q": { "_id": id }, "u": { "$set": { "balance": balance } } }] }
    };
    // Invalid before, invalid after: moderate lets it through.
    let reply = command(&t.db, set(1, -5)).await;
    assert!(write_errors(&reply).is_empty(), "{reply}");
    // Valid before: the change is checked.
    let reply = command(&t.db, set(2, -5)).await;
    assert_eq!(write_errors(&reply).len(), 1, "{reply}");
    command(
        &t.db,
        doc! { "collMod": "acc", "validationLevel": "strict" },
    )
    .await;
    let reply = command(&t.db, set(1, -6)).await;
    assert_eq!(
        write_errors(&reply).first().map(|e| int(e, "code")),
        Some(121),
        "strict checks every update: {reply}"
    );
}

/// https://www.mongodb.com/docs/manual/core/schema-validation/handle-invalid-documents/ :
/// `validationAction: "warn"` stores an invalid document (and logs it); `bypassDocumentValidation`
/// skips the validator for one command.
#[tokio::test]
async fn validation_action_warn_and_bypass_let_invalid_documents_in() {
    let t = TestDb::unprobed().await;
    with_validator(
        &t.db,
        "warned",
        doc! { "validator": account_schema(), "validationAction": "warn" },
    )
    .await;
    assert!(!refused_by_validator(&t.db, "warned", doc! { "_id": 1 }).await);
    with_validator(&t.db, "strict", doc! { "validator": account_schema() }).await;
    assert!(refused_by_validator(&t.db, "strict", doc! { "_id": 1 }).await);
    let reply = command(
        &t.db,
        doc! { "insert": "strict", "documents": [{ "_id": 1 }], "bypassDocumentValidation": true },
    )
    .await;
    assert!(write_errors(&reply).is_empty(), "{reply}");
}

/// https://www.mongodb.com/docs/manual/reference/command/collMod/#validator and
/// https://www.mongodb.com/docs/manual/reference/command/listCollections/ : `collMod` replaces a
/// collection's validator, which `listCollections` then reports in `options`, and writes are
/// judged by the new one.
#[tokio::test]
async fn coll_mod_replaces_the_validator_and_list_collections_reports_it() {
    let t = TestDb::unprobed().await;
    with_validator(&t.db, "acc", doc! { "validator": account_schema() }).await;
    let loose = doc! { "$jsonSchema": { "bsonType": "object", "required": ["owner"] } };
    command(&t.db, doc! { "collMod": "acc", "validator": loose.clone() }).await;
    let listed = command(
        &t.db,
        doc! { "listCollections": 1, "filter": { "name": "acc" } },
    )
    .await;
    let first = listed
        .get_document("cursor")
        .and_then(|c| c.get_array("firstBatch"))
        .expect("firstBatch")[0]
        .as_document()
        .expect("an entry")
        .clone();
    assert_eq!(
        first
            .get_document("options")
            .and_then(|o| o.get_document("validator")),
        Ok(&loose),
        "{first}"
    );
    assert!(!refused_by_validator(&t.db, "acc", doc! { "_id": 1, "owner": "ann" }).await);
    assert!(refused_by_validator(&t.db, "acc", doc! { "_id": 2 }).await);
    let code = command_error_code(
        &t.db,
        doc! { "collMod": "no_such_collection", "validator": loose },
    )
    .await;
    assert_eq!(
        code, 26,
        "collMod of a missing collection is NamespaceNotFound"
    );
}

/// https://www.mongodb.com/docs/manual/core/schema-validation/specify-query-expression-rules/ :
/// a validator is a query; `$jsonSchema` combines with other query operators (`$or`, `$exists`,
/// `$expr`), which is how mongotx lets tombstones through.
#[tokio::test]
async fn validators_combine_json_schema_with_query_operators() {
    let t = TestDb::unprobed().await;
    let validator = doc! {
        "$or": [
            { "deleted": { "$exists": true } },
            account_schema(),
        ],
        "$expr": { "$ne": ["$owner", "nobody"] },
    };
    with_validator(&t.db, "acc", doc! { "validator": validator }).await;
    assert!(!refused_by_validator(&t.db, "acc", doc! { "_id": 1, "deleted": true }).await);
    assert!(
        !refused_by_validator(
            &t.db,
            "acc",
            doc! { "_id": 2, "owner": "a", "balance": 0_i64 }
        )
        .await
    );
    assert!(refused_by_validator(&t.db, "acc", doc! { "_id": 3, "owner": "a" }).await);
    assert!(
        refused_by_validator(
            &t.db,
            "acc",
            doc! { "_id": 4, "owner": "nobody", "deleted": 1 }
        )
        .await
    );
}

/// https://www.mongodb.com/docs/manual/reference/operator/query/jsonSchema/ : the keywords MongoDB
/// supports, each with a document it accepts and one it refuses. Keywords about numbers, strings,
/// objects or arrays pass values of other types; `bsonType` tells int, long and double apart while
/// `number` takes them all; `minLength` and `maxLength` count code points; null is a value, not a
/// missing field.
#[tokio::test]
async fn json_schema_keywords_behave_as_the_manual_says() {
    let t = TestDb::unprobed().await;
    let cases: Vec<(Document, Vec<(Document, bool)>)> = vec![
        (
            doc! { "properties": { "x": { "bsonType": "long" } } },
            vec![
                (doc! { "x": 1_i64 }, true),
                (doc! { "x": 1_i32 }, false),
                (doc! { "x": 1.0 }, false),
                (doc! {}, true),
                (doc! { "x": Bson::Null }, false),
            ],
        ),
        (
            doc! { "properties": { "x": { "bsonType": "number" } } },
            vec![
                (doc! { "x": 1_i32 }, true),
                (doc! { "x": 1_i64 }, true),
                (doc! { "x": 1.5 }, true),
                (doc! { "x": "1" }, false),
            ],
        ),
        (
            doc! { "properties": { "x": { "bsonType": ["string", "null"] } } },
            vec![
                (doc! { "x": Bson::Null }, true),
                (doc! { "x": "a" }, true),
                (doc! { "x": 1 }, false),
            ],
        ),
        (
            doc! { "properties": { "x": { "type": "number" }, "b": { "type": "boolean" } } },
            vec![
                (doc! { "x": 1_i32, "b": true }, true),
                (doc! { "b": 1 }, false),
            ],
        ),
        (
            doc! { "required": ["x"] },
            vec![(doc! { "x": Bson::Null }, true), (doc! { "y": 1 }, false)],
        ),
        (
            doc! {
                "properties": { "_id": {}, "a": {} },
                "additionalProperties": false,
            },
            vec![(doc! { "a": 1 }, true), (doc! { "a": 1, "b": 2 }, false)],
        ),
        (
            doc! {
                "properties": { "_id": {} },
                "additionalProperties": { "bsonType": "int" },
            },
            vec![(doc! { "n": 1 }, true), (doc! { "n": "one" }, false)],
        ),
        (
            doc! {
                "properties": { "_id": {} },
                "patternProperties": { "^s_": { "bsonType": "string" } },
                "additionalProperties": false,
            },
            vec![
                (doc! { "s_a": "x" }, true),
                (doc! { "s_a": 1 }, false),
                (doc! { "t": "x" }, false),
            ],
        ),
        (
            doc! { "properties": { "x": { "enum": [1, "a"] } } },
            vec![
                (doc! { "x": 1.0 }, true),
                (doc! { "x": 1_i64 }, true),
                (doc! { "x": "a" }, true),
                (doc! { "x": 2 }, false),
            ],
        ),
        (
            doc! { "properties": { "x": { "minimum": 0, "maximum": 10_i64 } } },
            vec![
                (doc! { "x": 0 }, true),
                (doc! { "x": 10 }, true),
                (doc! { "x": -1 }, false),
                (doc! { "x": 10.5 }, false),
                (doc! { "x": "not a number" }, true),
            ],
        ),
        (
            doc! { "properties": { "x": { "minimum": 0, "exclusiveMinimum": true } } },
            vec![(doc! { "x": 0.5 }, true), (doc! { "x": 0 }, false)],
        ),
        (
            doc! { "properties": { "x": { "multipleOf": 3 } } },
            vec![
                (doc! { "x": 9 }, true),
                (doc! { "x": 9.0 }, true),
                (doc! { "x": 10 }, false),
            ],
        ),
        (
            doc! { "properties": { "s": { "minLength": 2, "maxLength": 3 } } },
            vec![
                (doc! { "s": "ab" }, true),
                (doc! { "s": "\u{e9}\u{e9}\u{e9}" }, true),
                (doc! { "s": "a" }, false),
                (doc! { "s": "abcd" }, false),
                (doc! { "s": 12345 }, true),
            ],
        ),
        (
            doc! { "properties": { "s": { "pattern": "^[a-z]+$" }, "t": { "pattern": "b" } } },
            vec![
                (doc! { "s": "abc", "t": "abc" }, true),
                (doc! { "s": "ab1" }, false),
                (doc! { "t": "xyz" }, false),
            ],
        ),
        (
            doc! { "properties": { "a": { "items": { "bsonType": "int" }, "minItems": 1, "maxItems": 2 } } },
            vec![
                (doc! { "a": [1, 2] }, true),
                (doc! { "a": [1, "x"] }, false),
                (doc! { "a": [] }, false),
                (doc! { "a": [1, 2, 3] }, false),
            ],
        ),
        (
            doc! { "properties": { "a": {
                "items": [{ "bsonType": "int" }, { "bsonType": "string" }],
                "additionalItems": false,
            } } },
            vec![
                (doc! { "a": [1, "x"] }, true),
                (doc! { "a": [1] }, true),
                (doc! { "a": [1, "x", 3] }, false),
                (doc! { "a": ["x"] }, false),
            ],
        ),
        (
            doc! { "properties": { "a": { "uniqueItems": true } } },
            vec![(doc! { "a": [1, 2] }, true), (doc! { "a": [1, 1] }, false)],
        ),
        (
            doc! { "properties": { "x": {
                "allOf": [{ "minimum": 0 }, { "maximum": 5 }],
                "anyOf": [{ "bsonType": "int" }, { "bsonType": "long" }],
            } } },
            vec![
                (doc! { "x": 3 }, true),
                (doc! { "x": 6 }, false),
                (doc! { "x": 3.5 }, false),
            ],
        ),
        (
            doc! { "properties": { "x": { "oneOf": [{ "minimum": 0 }, { "maximum": 5 }] } } },
            vec![
                (doc! { "x": 7 }, true),
                (doc! { "x": -1 }, true),
                (doc! { "x": 3 }, false),
            ],
        ),
        (
            doc! { "properties": { "x": { "not": { "bsonType": "string" } } } },
            vec![(doc! { "x": 1 }, true), (doc! { "x": "a" }, false)],
        ),
        (
            doc! { "dependencies": { "a": ["b"], "c": { "required": ["d"] } } },
            vec![
                (doc! { "a": 1, "b": 1 }, true),
                (doc! { "b": 1 }, true),
                (doc! { "a": 1 }, false),
                (doc! { "c": 1 }, false),
                (doc! { "c": 1, "d": 1 }, true),
            ],
        ),
        (
            doc! { "minProperties": 2, "maxProperties": 3 },
            vec![
                (doc! { "a": 1 }, true),
                (doc! {}, false),
                (doc! { "a": 1, "b": 2, "c": 3 }, false),
            ],
        ),
        (
            doc! { "properties": { "o": {
                "bsonType": "object",
                "required": ["k"],
                "properties": { "k": { "bsonType": "int" } },
            } } },
            vec![
                (doc! { "o": { "k": 1 } }, true),
                (doc! { "o": {} }, false),
                (doc! { "o": { "k": "1" } }, false),
            ],
        ),
    ];
    let mut checked = 0;
    for (n, (schema, documents)) in cases.into_iter().enumerate() {
        let name = format!("case{n}");
        with_validator(
            &t.db,
            &name,
            doc! { "validator": { "$jsonSchema": schema.clone() } },
        )
        .await;
        for (i, (mut document, valid)) in documents.into_iter().enumerate() {
            document.insert("_id", i as i32);
            let refused = refused_by_validator(&t.db, &name, document.clone()).await;
            assert_eq!(
                !refused,
                valid,
                "schema {schema}: {document} should be {}",
                if valid { "accepted" } else { "refused" }
            );
            checked += 1;
        }
    }
    assert!(checked > 60, "{checked} cases");
}

// ---------------------------------------------------------------------------------------------
// $$NOW
// ---------------------------------------------------------------------------------------------

/// Stages that keep the server busy for a few milliseconds between two readings of `$$NOW`.
fn spin(n: i32) -> Document {
    doc! { "$set": { "spin": { "$size": { "$range": [0, n] } } } }
}

/// https://www.mongodb.com/docs/manual/reference/aggregation-variables/#mongodb-variable-variable.NOW :
/// `$$NOW` "returns the same value for all members of the deployment and remains the same
/// throughout all stages of the aggregation pipeline", including an update's pipeline.
#[tokio::test]
async fn now_is_one_instant_across_the_stages_of_a_pipeline_update() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("clock");
    coll.insert_one(doc! { "_id": 1 }).await.expect("insert");
    for _ in 0..3 {
        let pipeline = vec![
            doc! { "$set": { "a": "$$NOW" } },
            spin(300_000),
            doc! { "$set": { "b": "$$NOW" } },
            doc! { "$unset": "spin" },
        ];
        coll.update_one(doc! { "_id": 1 }, pipeline)
            .await
            .expect("pipeline update");
        let stored = coll
            .find_one(doc! { "_id": 1 })
            .await
            .expect("find")
            .expect("doc");
        assert_eq!(stored.get("a"), stored.get("b"), "{stored}");
        assert!(stored.get_datetime("a").is_ok(), "{stored}");
    }
}

/// Same page: one statement has one `$$NOW`, so every document a multi-document update changes
/// gets the same instant.
#[tokio::test]
async fn now_is_one_instant_across_the_documents_of_a_multi_update() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("clock");
    coll.insert_many((0..40).map(|i| doc! { "_id": i }))
        .await
        .expect("insert");
    let pipeline = vec![
        spin(100_000),
        doc! { "$set": { "t": "$$NOW" } },
        doc! { "$unset": "spin" },
    ];
    let done = coll
        .update_many(doc! {}, pipeline)
        .await
        .expect("multi pipeline update");
    assert_eq!(done.modified_count, 40);
    let stamps: BTreeSet<i64> = all(&coll)
        .await
        .iter()
        .map(|d| d.get_datetime("t").expect("t").timestamp_millis())
        .collect();
    assert_eq!(stamps.len(), 1, "{stamps:?}");
}

/// Same page: the filter of a statement and its update read the same `$$NOW`, so a deadline the
/// filter found not yet passed is not passed for the update either.
#[tokio::test]
async fn a_statement_filter_and_its_update_see_the_same_now() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("clock");
    coll.insert_one(doc! { "_id": 1 }).await.expect("insert");
    let mut matched = 0;
    for attempt in 0..40_i64 {
        // A deadline a few milliseconds after the server's now.
        let ahead = 1 + attempt % 12;
        coll.update_one(
            doc! { "_id": 1 },
            vec![doc! { "$set": { "deadline": { "$add": ["$$NOW", ahead] } } }],
        )
        .await
        .expect("set deadline");
        let done = coll
            .update_one(
                doc! { "_id": 1, "$expr": { "$lte": ["$$NOW", "$deadline"] } },
                vec![
                    spin(200_000),
                    doc! { "$set": { "late": { "$gt": ["$$NOW", "$deadline"] } } },
                    doc! { "$unset": "spin" },
                ],
            )
            .await
            .expect("guarded update");
        if done.matched_count == 1 {
            matched += 1;
            let stored = coll
                .find_one(doc! { "_id": 1 })
                .await
                .expect("find")
                .expect("doc");
            assert_eq!(
                stored.get_bool("late"),
                Ok(false),
                "the filter saw the deadline ahead, the update saw it passed: {stored}"
            );
        }
    }
    assert!(
        matched > 0,
        "no attempt met its deadline: the check never ran"
    );
}

// ---------------------------------------------------------------------------------------------
// Comparison order
// ---------------------------------------------------------------------------------------------

/// https://www.mongodb.com/docs/manual/reference/bson-type-comparison-order/ and
/// https://www.mongodb.com/docs/manual/reference/operator/aggregation/eq/ : in aggregation
/// expressions a missing field is not null and sorts before it; in a query, `{a: null}` matches
/// both (https://www.mongodb.com/docs/manual/tutorial/query-for-null-fields/).
#[tokio::test]
async fn expressions_tell_a_missing_field_from_null() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("nulls");
    coll.insert_many([
        doc! { "_id": 1 },
        doc! { "_id": 2, "a": Bson::Null },
        doc! { "_id": 3, "a": 0 },
    ])
    .await
    .expect("insert");
    assert_matches(&coll, doc! { "$expr": { "$eq": ["$a", Bson::Null] } }, &[2]).await;
    assert_matches(&coll, doc! { "$expr": { "$lt": ["$a", Bson::Null] } }, &[1]).await;
    assert_matches(&coll, doc! { "$expr": { "$gt": ["$a", Bson::Null] } }, &[3]).await;
    assert_matches(&coll, doc! { "a": Bson::Null }, &[1, 2]).await;
}

/// https://www.mongodb.com/docs/manual/reference/bson-type-comparison-order/#strings : strings
/// compare by their bytes (the simple binary comparison of UTF-8) unless a collation says
/// otherwise, in sorts, query operators and expressions alike. U+FF61 (EF BD A1) is below U+1F600
/// (F0 9F 98 80), although its UTF-16 code unit (FF61) is above the emoji's (D83D).
#[tokio::test]
async fn strings_compare_and_sort_by_their_utf8_bytes() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("strings");
    let (a, e, half_stop, emoji) = ("a", "\u{e9}", "\u{ff61}", "\u{1f600}");
    coll.insert_many([
        doc! { "_id": 1, "s": emoji },
        doc! { "_id": 2, "s": half_stop },
        doc! { "_id": 3, "s": e },
        doc! { "_id": 4, "s": a },
    ])
    .await
    .expect("insert");
    assert_eq!(
        ids(&coll, doc! {}, doc! { "s": 1 }).await,
        vec![
            Bson::Int32(4),
            Bson::Int32(3),
            Bson::Int32(2),
            Bson::Int32(1)
        ]
    );
    assert_matches(&coll, doc! { "s": { "$gt": half_stop } }, &[1]).await;
    assert_matches(
        &coll,
        doc! { "$expr": { "$lt": ["$s", half_stop] } },
        &[3, 4],
    )
    .await;
}

/// https://www.mongodb.com/docs/manual/reference/bson-type-comparison-order/ : values of
/// different types sort by type (null, numbers, strings, objects, binary data, ObjectId, booleans,
/// dates), numbers of every type by value, and a missing field sorts as null.
#[tokio::test]
async fn values_sort_in_bson_comparison_order() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("order");
    let when = DateTime::from_millis(1_700_000_000_000);
    coll.insert_many([
        doc! { "_id": 1, "v": when },
        doc! { "_id": 2, "v": true },
        doc! { "_id": 3, "v": ObjectId::parse_str("650000000000000000000000").expect("oid") },
        doc! { "_id": 4, "v": Bson::Binary(bson::Binary { subtype: bson::spec::BinarySubtype::Generic, bytes: vec![1] }) },
        doc! { "_id": 5, "v": { "k": 1 } },
        doc! { "_id": 6, "v": "text" },
        doc! { "_id": 7, "v": 2.5 },
        doc! { "_id": 8, "v": 2_i64 },
        doc! { "_id": 9, "v": 1_i32 },
        doc! { "_id": 10, "v": Bson::Null },
    ])
    .await
    .expect("insert");
    let sorted = ids(&coll, doc! {}, doc! { "v": 1, "_id": 1 }).await;
    let expected: Vec<Bson> = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
        .into_iter()
        .map(Bson::Int32)
        .collect();
    assert_eq!(sorted, expected);
    // A document without the field sorts with null.
    coll.insert_one(doc! { "_id": 0 }).await.expect("insert");
    let first_two = ids(&coll, doc! {}, doc! { "v": 1, "_id": 1 }).await[..2].to_vec();
    assert_eq!(first_two, vec![Bson::Int32(0), Bson::Int32(10)]);
}

/// https://www.mongodb.com/docs/manual/reference/bson-type-comparison-order/#numeric-types :
/// numbers compare by their exact value whatever their type, so a long 5 is below the double 5.5
/// and above 4.5.
#[tokio::test]
async fn numbers_compare_exactly_across_types() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("numbers");
    coll.insert_many([
        doc! { "_id": 1, "v": 5_i64 },
        doc! { "_id": 2, "v": 5.25 },
        doc! { "_id": 3, "v": 9_007_199_254_740_993_i64 },
        doc! { "_id": 4, "v": 9_007_199_254_740_992.0 },
    ])
    .await
    .expect("insert");
    assert_matches(&coll, doc! { "v": { "$lt": 5.5 } }, &[1, 2]).await;
    assert_matches(&coll, doc! { "v": { "$gt": 4.5, "$lt": 5.1 } }, &[1]).await;
    assert_matches(&coll, doc! { "$expr": { "$lt": ["$v", 5.1] } }, &[1]).await;
    assert_eq!(
        ids(&coll, doc! {}, doc! { "v": -1 }).await[..2].to_vec(),
        vec![Bson::Int32(3), Bson::Int32(4)]
    );
}

/// https://www.mongodb.com/docs/manual/reference/operator/update/set/ : `$set` replaces the value
/// of a field with the specified value, so a value equal to the stored one as queries compare
/// (int 5 and long 5, decimal 1.0 and 1.00, 0.0 and -0.0) still replaces it in the given type
/// and bytes. (A plain document's first write relies on it to tell a raw change of type only.)
#[tokio::test]
async fn set_stores_a_value_equal_under_comparison_in_the_type_given() {
    use std::str::FromStr;
    let dec = |s: &str| Bson::Decimal128(bson::Decimal128::from_str(s).expect("decimal"));
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("representations");
    for (i, (before, after)) in [
        (Bson::Int32(5), Bson::Int64(5)),
        (Bson::Int64(5), Bson::Double(5.0)),
        (Bson::Double(5.0), dec("5.0")),
        (dec("1.0"), dec("1.00")),
        (Bson::Double(0.0), Bson::Double(-0.0)),
        (
            Bson::Document(doc! { "a": [1_i32, { "b": 2_i32 }] }),
            Bson::Document(doc! { "a": [1_i32, { "b": 2_i64 }] }),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let id = i as i32;
        coll.insert_one(doc! { "_id": id, "v": before.clone() })
            .await
            .expect("insert");
        let result = coll
            .update_one(doc! { "_id": id }, doc! { "$set": { "v": after.clone() } })
            .await
            .expect("update");
        assert_eq!(
            (result.matched_count, result.modified_count),
            (1, 1),
            "{before} -> {after}"
        );
        let stored = coll
            .find_one(doc! { "_id": id })
            .await
            .expect("read")
            .expect("stored");
        assert_eq!(
            bson::to_vec(&stored).expect("bytes"),
            bson::to_vec(&doc! { "_id": id, "v": after.clone() }).expect("bytes"),
            "{before} -> {after}"
        );
    }
}

/// https://www.mongodb.com/docs/manual/reference/operator/query/type/ : `$type` matches the
/// BSON type of the value at a path (`int`, `long`, `double`, `decimal`, `string`), where `$eq`
/// matches by value across the number types; a path's number addresses an array element
/// (https://www.mongodb.com/docs/manual/core/document/#dot-notation).
#[tokio::test]
async fn type_conditions_tell_the_number_types_apart() {
    use std::str::FromStr;
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("types");
    let five = bson::Decimal128::from_str("5").expect("decimal");
    coll.insert_many([
        doc! { "_id": 1, "v": 5_i32, "a": [5_i32, 5_i64] },
        doc! { "_id": 2, "v": 5_i64, "a": [5_i64, 5_i32] },
        doc! { "_id": 3, "v": 5.0, "a": [{ "n": 5.0 }] },
        doc! { "_id": 4, "v": five, "a": [[5_i32]] },
    ])
    .await
    .expect("insert");
    assert_matches(&coll, doc! { "v": 5 }, &[1, 2, 3, 4]).await;
    assert_matches(&coll, doc! { "v": { "$type": "int" } }, &[1]).await;
    assert_matches(&coll, doc! { "v": { "$type": "long" } }, &[2]).await;
    assert_matches(&coll, doc! { "v": { "$type": "double" } }, &[3]).await;
    assert_matches(&coll, doc! { "v": { "$type": "decimal" } }, &[4]).await;
    assert_matches(&coll, doc! { "a.1": { "$type": "long" } }, &[1]).await;
    assert_matches(&coll, doc! { "a.0.n": { "$type": "double" } }, &[3]).await;
    assert_matches(&coll, doc! { "a.0.0": { "$type": "int" } }, &[4]).await;
}

/// https://www.mongodb.com/docs/manual/reference/operator/aggregation/toString/ : a decimal and a
/// double convert to their own string forms, so decimals of another precision (1.0, 1.00) and
/// the two zeros (0.0, -0.0), equal to `$eq`, differ there; and
/// https://www.mongodb.com/docs/manual/reference/operator/aggregation/strLenBytes/ and
/// https://www.mongodb.com/docs/manual/reference/operator/aggregation/indexOfBytes/ : byte
/// lengths and byte positions of strings.
#[tokio::test]
async fn string_forms_and_bytes_tell_what_eq_does_not() {
    use std::str::FromStr;
    let dec = |s: &str| Bson::Decimal128(bson::Decimal128::from_str(s).expect("decimal"));
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("forms");
    coll.insert_one(doc! { "_id": 1, "d": dec("1.0"), "z": -0.0, "s": "Straße" })
        .await
        .expect("insert");
    assert_matches(
        &coll,
        doc! { "$expr": { "$eq": ["$d", dec("1.00")] } },
        &[1],
    )
    .await;
    assert_matches(&coll, doc! { "$expr": { "$eq": ["$z", 0.0] } }, &[1]).await;
    let same_form = |path: &str, value: Bson| {
        doc! { "$expr": { "$eq": [{ "$toString": path }, { "$toString": { "$literal": value } }] } }
    };
    assert_matches(&coll, same_form("$d", dec("1.0")), &[1]).await;
    assert_matches(&coll, same_form("$d", dec("1.00")), &[]).await;
    assert_matches(&coll, same_form("$z", Bson::Double(-0.0)), &[1]).await;
    assert_matches(&coll, same_form("$z", Bson::Double(0.0)), &[]).await;
    assert_matches(
        &coll,
        doc! { "$expr": { "$eq": [{ "$strLenBytes": "$s" }, 7] } },
        &[1],
    )
    .await;
    assert_matches(
        &coll,
        doc! { "$expr": { "$eq": [{ "$indexOfBytes": ["$s", "Straße"] }, 0] } },
        &[1],
    )
    .await;
    assert_matches(
        &coll,
        doc! { "$expr": { "$eq": [{ "$indexOfBytes": ["$s", "STRASSE"] }, -1] } },
        &[1],
    )
    .await;
    // A value deep in documents inside arrays: a field path through an array of documents gives
    // one value per element (https://www.mongodb.com/docs/manual/reference/operator/aggregation/arrayElemAt/
    // and https://www.mongodb.com/docs/manual/core/field-paths/), taken apart by `$arrayElemAt`.
    coll.insert_one(doc! { "_id": 2, "a": [{ "b": { "c": -0.0 } }, { "b": { "c": 1.5 } }] })
        .await
        .expect("insert");
    let deep = |i: i64| Bson::Document(doc! { "$arrayElemAt": ["$a.b.c", i] });
    assert_matches(&coll, same_form_of(deep(0), Bson::Double(-0.0)), &[2]).await;
    assert_matches(&coll, same_form_of(deep(1), Bson::Double(1.5)), &[2]).await;
    assert_matches(&coll, same_form_of(deep(0), Bson::Double(0.0)), &[]).await;
}

/// `{$expr: {$eq: [{$toString: expr}, {$toString: value}]}}`.
fn same_form_of(expr: Bson, value: Bson) -> Document {
    doc! { "$expr": { "$eq": [{ "$toString": expr }, { "$toString": { "$literal": value } }] } }
}

/// https://www.mongodb.com/docs/manual/reference/collation/ : an operation on a collection with a
/// default collation uses it unless the operation names its own (`{locale: "simple"}` is the
/// binary comparison), so at strength 2 an expression's `$eq` takes "Alice" for "alice", and a
/// whole document compared with `$eq` hides a change of case; `$strLenBytes` and `$indexOfBytes`
/// (https://www.mongodb.com/docs/manual/reference/operator/aggregation/indexOfBytes/) work on the
/// bytes whatever the collation.
#[tokio::test]
async fn expressions_compare_strings_under_the_collections_collation() {
    let t = TestDb::unprobed().await;
    t.db.run_command(doc! {
        "create": "folded",
        "collation": { "locale": "en", "strength": 2 },
    })
    .await
    .expect("create with a collation");
    let coll: Collection<Document> = t.db.collection("folded");
    coll.insert_one(doc! { "_id": 1, "s": "Alice" })
        .await
        .expect("insert");
    assert_matches(&coll, doc! { "$expr": { "$eq": ["$s", "alice"] } }, &[1]).await;
    assert_matches(
        &coll,
        doc! { "$expr": { "$eq": ["$$ROOT", { "$literal": { "_id": 1, "s": "ALICE" } }] } },
        &[1],
    )
    .await;
    let simple: Vec<Document> = coll
        .find(doc! { "$expr": { "$eq": ["$s", "alice"] } })
        .collation(
            mongodb::options::Collation::builder()
                .locale("simple")
                .build(),
        )
        .await
        .expect("find")
        .try_collect()
        .await
        .expect("find");
    assert!(simple.is_empty(), "{simple:?}");
    assert_matches(
        &coll,
        doc! { "$expr": { "$eq": [{ "$indexOfBytes": ["$s", "alice"] }, -1] } },
        &[1],
    )
    .await;
    assert_matches(
        &coll,
        doc! { "$expr": { "$eq": [{ "$indexOfBytes": ["$s", "Alice"] }, 0] } },
        &[1],
    )
    .await;
}

/// https://www.mongodb.com/docs/manual/core/document/#document-field-order : MongoDB keeps the
/// order of a document's fields through writes, `_id` first; a replacement (a `replaceOne`, or a
/// pipeline update's `$replaceWith`) is stored in its own order. (An undo that puts back a field
/// its transaction removed relies on it to leave the document as it was.)
#[tokio::test]
async fn a_replacement_is_stored_in_its_own_field_order() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("ordered");
    coll.insert_one(doc! { "_id": 1, "a": 1, "b": 2 })
        .await
        .expect("insert");
    coll.replace_one(doc! { "_id": 1 }, doc! { "c": 3, "b": 2, "a": 1 })
        .await
        .expect("replace");
    let names = |d: Document| d.keys().cloned().collect::<Vec<_>>();
    let stored = coll.find_one(doc! {}).await.expect("read").expect("stored");
    assert_eq!(names(stored), ["_id", "c", "b", "a"]);
    // A field whose expression yields nothing is left out
    // (https://www.mongodb.com/docs/manual/reference/operator/aggregation/replaceWith/).
    coll.update_one(
        doc! { "_id": 1 },
        vec![doc! { "$replaceWith": { "a": "$a", "gone": "$nothing.here", "z": 26, "c": "$c" } }],
    )
    .await
    .expect("pipeline update");
    let stored = coll.find_one(doc! {}).await.expect("read").expect("stored");
    assert_eq!(names(stored), ["_id", "a", "z", "c"]);
}

// ---------------------------------------------------------------------------------------------
// Pipeline updates
// ---------------------------------------------------------------------------------------------

/// https://www.mongodb.com/docs/manual/tutorial/update-documents-with-aggregation-pipeline/ and
/// https://www.mongodb.com/docs/manual/reference/operator/aggregation/replaceWith/ : an update's
/// `_id` is immutable; a replacement stage whose result has no `_id` keeps the document's.
#[tokio::test]
async fn a_pipeline_update_keeps_the_id_its_result_leaves_out() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("keep");
    coll.insert_many([doc! { "_id": 1, "a": 1 }, doc! { "_id": 2, "a": 2 }])
        .await
        .expect("insert");
    coll.update_one(
        doc! { "_id": 1 },
        vec![doc! { "$replaceWith": { "b": "$a" } }],
    )
    .await
    .expect("replaceWith");
    coll.update_one(
        doc! { "_id": 2 },
        vec![doc! { "$replaceRoot": { "newRoot": { "c": "$a" } } }],
    )
    .await
    .expect("replaceRoot");
    assert_eq!(
        all(&coll).await,
        vec![doc! { "_id": 1, "b": 1 }, doc! { "_id": 2, "c": 2 }]
    );
    let e = coll
        .update_one(doc! { "_id": 1 }, vec![doc! { "$set": { "_id": 9 } }])
        .await
        .expect_err("changing _id");
    assert_eq!(code_of(&e), Some(66), "ImmutableField: {e}");
}

/// https://www.mongodb.com/docs/manual/reference/method/db.collection.updateMany/#update-with-aggregation-pipeline :
/// a pipeline update may change many documents, each by its own values.
#[tokio::test]
async fn a_pipeline_update_changes_many_documents() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("many");
    coll.insert_many((1..=5).map(|i| doc! { "_id": i, "n": i }))
        .await
        .expect("insert");
    let done = coll
        .update_many(
            doc! { "n": { "$gte": 2 } },
            vec![doc! { "$set": { "n": { "$multiply": ["$n", 10] } } }],
        )
        .await
        .expect("updateMany with a pipeline");
    assert_eq!((done.matched_count, done.modified_count), (4, 4));
    let values: Vec<i64> = all(&coll).await.iter().map(|d| int(d, "n")).collect();
    assert_eq!(values, vec![1, 20, 30, 40, 50]);
}

/// https://www.mongodb.com/docs/manual/reference/method/db.collection.updateOne/#insert-a-new-document-if-no-match-exists--upsert-
/// and "Upsert with Dotted _id Query" on the update page: an upsert that matches nothing starts
/// from the filter's equality conditions, dotted paths and `$and` clauses included (not from
/// ranges), then applies the update, whether operators or a pipeline.
#[tokio::test]
async fn an_upsert_is_seeded_from_the_filters_equalities() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("seeded");
    let filter = |id: i32| {
        doc! {
            "_id": id,
            "a.b": 1,
            "$and": [{ "c": 2 }, { "d": { "$eq": 3 } }],
            "e": { "$gt": 5 },
        }
    };
    coll.update_one(filter(1), doc! { "$set": { "x": 1 } })
        .upsert(true)
        .await
        .expect("operator upsert");
    coll.update_one(filter(2), vec![doc! { "$set": { "x": "$c" } }])
        .upsert(true)
        .await
        .expect("pipeline upsert");
    let stored = all(&coll).await;
    assert_eq!(
        stored,
        vec![
            doc! { "_id": 1, "a": { "b": 1 }, "c": 2, "d": 3, "x": 1 },
            doc! { "_id": 2, "a": { "b": 1 }, "c": 2, "d": 3, "x": 2 },
        ]
    );
}

/// https://www.mongodb.com/docs/manual/core/document/#the-_id-field : `_id` may hold any type but
/// an array, a regex or undefined, null included; an upsert on `{_id: null}` stores that null.
#[tokio::test]
async fn an_upsert_on_a_null_id_stores_a_null_id() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("nullid");
    let done = coll
        .update_one(doc! { "_id": Bson::Null }, doc! { "$set": { "a": 1 } })
        .upsert(true)
        .await
        .expect("upsert");
    assert_eq!(done.upserted_id, Some(Bson::Null));
    assert_eq!(all(&coll).await, vec![doc! { "_id": Bson::Null, "a": 1 }]);
}

/// https://www.mongodb.com/docs/manual/reference/command/update/#output : an error in one
/// statement is that statement's write error (`writeErrors[].index`); an unordered command goes on
/// with the next statements, an ordered one stops. `n` and `nModified` count the documents of the
/// statements that succeeded: a failed statement's result is its write error (explicit adoption
/// counts its stamps by `n`, docs/adoption.md).
#[tokio::test]
async fn each_statement_of_an_unordered_update_fails_on_its_own() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("stmts");
    coll.insert_many([doc! { "_id": 1, "n": 1 }, doc! { "_id": 2, "n": 2 }])
        .await
        .expect("insert");
    let statements = |ordered: bool| {
        doc! {
            "update": "stmts",
            "ordered": ordered,
            "updates": [
                { "q": { "_id": 1 }, "u": [{ "$set": { "n": { "$divide": ["$n", 0] } } }] },
                { "q": { "_id": 2 }, "u": { "$inc": { "n": 10 } } },
            ],
        }
    };
    let reply = command(&t.db, statements(true)).await;
    let errors = write_errors(&reply);
    assert_eq!(errors.len(), 1, "{reply}");
    assert_eq!(int(&errors[0], "index"), 0);
    assert_eq!(
        int(&reply, "nModified"),
        0,
        "ordered stops at the first error: {reply}"
    );
    assert_eq!(
        int(&reply, "n"),
        0,
        "a failed statement counts in no total: {reply}"
    );
    let reply = command(&t.db, statements(false)).await;
    let errors = write_errors(&reply);
    assert_eq!(errors.len(), 1, "{reply}");
    assert_eq!(int(&errors[0], "index"), 0);
    assert_eq!(int(&reply, "nModified"), 1, "{reply}");
    assert_eq!(
        int(&reply, "n"),
        1,
        "only the statement that succeeded: {reply}"
    );
    assert_eq!(
        all(&coll).await,
        vec![doc! { "_id": 1, "n": 1 }, doc! { "_id": 2, "n": 12 }]
    );
}

/// https://www.mongodb.com/docs/manual/reference/operator/aggregation/unset/ : the `$unset` stage
/// removes top-level fields and embedded fields named by dotted paths, in an update pipeline and in
/// `aggregate`, where it leaves the stored documents as they were (as does an update whose
/// pipeline fails after it:
/// https://www.mongodb.com/docs/manual/core/write-operations-atomicity/); and
/// https://www.mongodb.com/docs/manual/reference/operator/aggregation/set/ : a field set from
/// another (`{b: "$a"}`) is a value of its own, which a later change of the first leaves alone, and
/// https://www.mongodb.com/docs/manual/reference/aggregation-variables/#mongodb-variable-variable.ROOT :
/// `$$ROOT` in a stage is the document as the stage received it.
#[tokio::test]
async fn the_unset_stage_removes_dotted_paths_and_copied_fields_stay_apart_from_their_source() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("unset_stage");
    coll.insert_one(doc! { "_id": 1, "a": { "x": 1, "y": 2 }, "keep": [1, 2], "drop": true })
        .await
        .expect("insert");
    let unset = doc! { "$unset": ["a.y", "drop"] };
    let read: Vec<Document> = coll
        .aggregate(vec![unset.clone()])
        .await
        .expect("aggregate")
        .try_collect()
        .await
        .expect("read");
    assert_eq!(
        read,
        vec![doc! { "_id": 1, "a": { "x": 1 }, "keep": [1, 2] }]
    );
    assert_eq!(
        all(&coll).await,
        vec![doc! { "_id": 1, "a": { "x": 1, "y": 2 }, "keep": [1, 2], "drop": true }],
        "aggregate changed the stored document"
    );
    // An update whose pipeline fails after the `$unset` stage changes nothing.
    let failed = coll
        .update_one(
            doc! { "_id": 1 },
            vec![
                unset.clone(),
                doc! { "$set": { "z": { "$divide": [1, 0] } } },
            ],
        )
        .await;
    assert!(failed.is_err(), "a division by zero was accepted");
    assert_eq!(
        all(&coll).await,
        vec![doc! { "_id": 1, "a": { "x": 1, "y": 2 }, "keep": [1, 2], "drop": true }],
        "a failed pipeline update changed the stored document"
    );
    coll.update_one(
        doc! { "_id": 1 },
        vec![unset, doc! { "$set": { "b": "$a", "k": "$keep" } }],
    )
    .await
    .expect("pipeline update");
    coll.update_one(
        doc! { "_id": 1 },
        doc! { "$set": { "a.x": 5 }, "$push": { "keep": 3 } },
    )
    .await
    .expect("operator update");
    assert_eq!(
        all(&coll).await,
        vec![doc! {
            "_id": 1, "a": { "x": 5 }, "keep": [1, 2, 3], "b": { "x": 1 }, "k": [1, 2],
        }]
    );
    coll.update_one(
        doc! { "_id": 1 },
        vec![doc! { "$set": { "a": 6, "snap": "$$ROOT" } }],
    )
    .await
    .expect("$$ROOT");
    assert_eq!(
        coll.find_one(doc! { "_id": 1 })
            .await
            .expect("read")
            .expect("stored")
            .get("snap"),
        Some(&Bson::Document(doc! {
            "_id": 1, "a": { "x": 5 }, "keep": [1, 2, 3], "b": { "x": 1 }, "k": [1, 2],
        })),
        "$$ROOT is the document before the stage"
    );
}

/// https://www.mongodb.com/docs/manual/tutorial/update-documents-with-aggregation-pipeline/ :
/// update pipelines take `$set`, `$unset` and `$replaceWith` (4.2+), and
/// https://www.mongodb.com/docs/manual/reference/command/update/#std-label-update-let-syntax :
/// `let` variables (5.0+; refused before as an unknown field).
#[tokio::test]
async fn update_pipelines_take_the_stage_aliases_and_let_variables() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("aliases");
    coll.insert_one(doc! { "_id": 1, "a": 1, "b": 2 })
        .await
        .expect("insert");
    coll.update_one(
        doc! { "_id": 1 },
        vec![
            doc! { "$set": { "c": { "$add": ["$a", "$b"] } } },
            doc! { "$unset": ["a"] },
            doc! { "$replaceWith": { "$mergeObjects": ["$$ROOT", { "d": "$c" }] } },
        ],
    )
    .await
    .expect("aliases");
    assert_eq!(
        all(&coll).await,
        vec![doc! { "_id": 1, "b": 2, "c": 3, "d": 3 }]
    );
    let with_let = doc! {
        "update": "aliases",
        "updates": [{ "q": { "_id": 1, "$expr": { "$eq": ["$b", "$$two"] } }, "u": [{ "$set": { "e": "$$two" } }] }],
        "let": { "two": 2 },
    };
    if version(&t.db).await < (5, 0) {
        assert!(t.db.run_command(with_let).await.is_err(), "let before 5.0");
        return;
    }
    let reply = command(&t.db, with_let).await;
    assert_eq!(int(&reply, "nModified"), 1, "{reply}");
    let found = command(
        &t.db,
        doc! { "find": "aliases", "filter": { "$expr": { "$eq": ["$e", "$$v"] } }, "let": { "v": 2 } },
    )
    .await;
    let batch = found
        .get_document("cursor")
        .and_then(|c| c.get_array("firstBatch"))
        .expect("firstBatch");
    assert_eq!(batch.len(), 1, "{found}");
}

// ---------------------------------------------------------------------------------------------
// findAndModify
// ---------------------------------------------------------------------------------------------

/// https://www.mongodb.com/docs/manual/reference/command/findAndModify/ (`fields`) and
/// https://www.mongodb.com/docs/manual/tutorial/project-fields-from-query-results/#return-specific-fields-in-embedded-documents :
/// a projection may name fields of embedded documents by dotted path, to include or exclude.
#[tokio::test]
async fn find_and_modify_projects_dotted_fields() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("proj");
    coll.insert_one(doc! { "_id": 1, "a": { "b": 1, "c": 2 }, "d": 3 })
        .await
        .expect("insert");
    let included = coll
        .find_one_and_update(doc! { "_id": 1 }, doc! { "$inc": { "d": 1 } })
        .projection(doc! { "a.b": 1 })
        .return_document(ReturnDocument::After)
        .await
        .expect("findAndModify")
        .expect("doc");
    assert_eq!(included, doc! { "_id": 1, "a": { "b": 1 } });
    let excluded = coll
        .find_one_and_update(doc! { "_id": 1 }, doc! { "$inc": { "d": 1 } })
        .projection(doc! { "a.c": 0, "d": 0 })
        .return_document(ReturnDocument::After)
        .await
        .expect("findAndModify")
        .expect("doc");
    assert_eq!(excluded, doc! { "_id": 1, "a": { "b": 1 } });
    // The same through a pipeline update (4.2+).
    let piped = coll
        .find_one_and_update(doc! { "_id": 1 }, vec![doc! { "$set": { "d": 0 } }])
        .projection(doc! { "a.c": 1, "d": 1, "_id": 0 })
        .return_document(ReturnDocument::After)
        .await
        .expect("findAndModify with a pipeline")
        .expect("doc");
    assert_eq!(piped, doc! { "a": { "c": 2 }, "d": 0 });
}

/// https://www.mongodb.com/docs/manual/reference/command/findAndModify/#behavior : the document is
/// modified atomically and `new: true` returns it as this call left it, so concurrent increments
/// each see their own value.
#[tokio::test]
async fn find_and_modify_returns_each_caller_its_own_post_image() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("tokens");
    coll.insert_one(doc! { "_id": 1, "n": 0_i64 })
        .await
        .expect("insert");
    let tasks = 48;
    let handed: Vec<i64> = join_all((0..tasks).map(|_| {
        let coll = coll.clone();
        tokio::spawn(async move {
            coll.find_one_and_update(doc! { "_id": 1 }, doc! { "$inc": { "n": 1_i64 } })
                .return_document(ReturnDocument::After)
                .await
                .expect("findAndModify")
                .expect("doc")
                .get_i64("n")
                .expect("n")
        })
    }))
    .await
    .into_iter()
    .map(|r| r.expect("task"))
    .collect();
    let distinct: BTreeSet<i64> = handed.iter().copied().collect();
    assert_eq!(distinct, (1..=tasks as i64).collect());
}

/// The same page, for a counter the first call creates (`upsert: true`): the caller whose upsert
/// inserted the document gets the document as it inserted it, not as the next caller's
/// increment left it a moment later (a token counter is created this way: OBT tokens handed out
/// twice were this). Each round races `tasks` increments on a counter that does not exist yet; a
/// caller whose upsert lost the race to insert may get a duplicate key error and sends again,
/// as the manual's "upsert and unique index" section says to.
#[tokio::test]
async fn find_and_modify_answers_the_upserting_caller_with_its_own_document() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("counters");
    let tasks = 8_i64;
    for round in 0..150_i64 {
        let handed: Vec<i64> = join_all((0..tasks).map(|_| {
            let coll = coll.clone();
            tokio::spawn(async move {
                loop {
                    let result = coll
                        .find_one_and_update(doc! { "_id": round }, doc! { "$inc": { "n": 1_i64 } })
                        .upsert(true)
                        .return_document(ReturnDocument::After)
                        .await;
                    match result {
                        Ok(found) => {
                            return found.expect("doc").get_i64("n").expect("n");
                        }
                        Err(e) if code_of(&e) == Some(11000) => continue,
                        Err(e) => panic!("findAndModify: {e}"),
                    }
                }
            })
        }))
        .await
        .into_iter()
        .map(|r| r.expect("task"))
        .collect();
        let distinct: BTreeSet<i64> = handed.iter().copied().collect();
        assert_eq!(distinct, (1..=tasks).collect(), "round {round}: {handed:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Duplicate keys, ids, indexes
// ---------------------------------------------------------------------------------------------

/// https://www.mongodb.com/docs/manual/core/index-unique/ and
/// https://www.mongodb.com/docs/manual/reference/command/insert/#output : a duplicate key is
/// write error 11000 whose message names the index, with the index's `keyPattern` and the
/// offending `keyValue`.
#[tokio::test]
async fn duplicate_key_errors_carry_the_index_key_pattern_and_value() {
    let t = TestDb::unprobed().await;
    command(
        &t.db,
        doc! { "createIndexes": "dups", "indexes": [{ "key": { "email": 1 }, "name": "email_1", "unique": true }] },
    )
    .await;
    insert_raw(&t.db, "dups", doc! { "_id": 1, "email": "a@x" }).await;
    let reply = insert_raw(&t.db, "dups", doc! { "_id": 1, "email": "b@x" }).await;
    let error = write_errors(&reply)
        .first()
        .cloned()
        .expect("duplicate _id");
    assert_eq!(int(&error, "code"), 11000);
    assert!(
        error.get_str("errmsg").unwrap_or("").contains("_id_"),
        "{error}"
    );
    assert_eq!(
        error.get_document("keyPattern"),
        Ok(&doc! { "_id": 1 }),
        "{error}"
    );
    assert_eq!(
        error.get_document("keyValue"),
        Ok(&doc! { "_id": 1 }),
        "{error}"
    );
    let reply = insert_raw(&t.db, "dups", doc! { "_id": 2, "email": "a@x" }).await;
    let error = write_errors(&reply)
        .first()
        .cloned()
        .expect("duplicate email");
    assert_eq!(int(&error, "code"), 11000);
    assert!(
        error.get_str("errmsg").unwrap_or("").contains("email_1"),
        "{error}"
    );
    assert_eq!(
        error.get_document("keyPattern"),
        Ok(&doc! { "email": 1 }),
        "{error}"
    );
    assert_eq!(
        error.get_document("keyValue"),
        Ok(&doc! { "email": "a@x" }),
        "{error}"
    );
    // An update into a taken key reports the same.
    insert_raw(&t.db, "dups", doc! { "_id": 3, "email": "c@x" }).await;
    let reply = command(
        &t.db,
        doc! { "update": "dups", "updates": [{ "q": { "_id": 3 }, "u": { "$set": { "email": "a@x" } } }] },
    )
    .await;
    let error = write_errors(&reply)
        .first()
        .cloned()
        .expect("duplicate by update");
    assert_eq!(int(&error, "code"), 11000);
    assert_eq!(
        error.get_document("keyValue"),
        Ok(&doc! { "email": "a@x" }),
        "{error}"
    );
}

/// https://www.mongodb.com/docs/manual/reference/command/insert/#output : `n` is the number of
/// documents inserted; an unordered insert goes past a refused document, an ordered one stops.
#[tokio::test]
async fn an_insert_counts_only_the_documents_it_inserted() {
    let t = TestDb::unprobed().await;
    let docs = || vec![doc! { "_id": 1 }, doc! { "_id": 1 }, doc! { "_id": 2 }];
    let reply = command(
        &t.db,
        doc! { "insert": "counted", "documents": docs(), "ordered": false },
    )
    .await;
    assert_eq!(int(&reply, "n"), 2, "{reply}");
    assert_eq!(int(&write_errors(&reply)[0], "index"), 1);
    let reply = command(
        &t.db,
        doc! { "insert": "counted_ordered", "documents": docs(), "ordered": true },
    )
    .await;
    assert_eq!(int(&reply, "n"), 1, "{reply}");
    assert_eq!(write_errors(&reply).len(), 1, "{reply}");
}

/// https://www.mongodb.com/docs/manual/core/index-unique/#missing-document-field-in-a-unique-single-field-index
/// and https://www.mongodb.com/docs/manual/core/index-sparse/#sparse-and-unique-properties : a
/// unique index stores a missing field as null, so a second document without it is a duplicate;
/// a sparse unique index leaves such documents out.
#[tokio::test]
async fn unique_indexes_take_a_missing_field_as_null_and_sparse_ones_skip_it() {
    let t = TestDb::unprobed().await;
    command(
        &t.db,
        doc! { "createIndexes": "uniq", "indexes": [
            { "key": { "u": 1 }, "name": "u_1", "unique": true },
            { "key": { "s": 1 }, "name": "s_1", "unique": true, "sparse": true },
        ] },
    )
    .await;
    let first = insert_raw(&t.db, "uniq", doc! { "_id": 1, "s": 1 }).await;
    assert!(write_errors(&first).is_empty(), "{first}");
    let second = insert_raw(&t.db, "uniq", doc! { "_id": 2, "s": 2 }).await;
    assert_eq!(
        write_errors(&second).first().map(|e| int(e, "code")),
        Some(11000),
        "a second document without u: {second}"
    );
    command(
        &t.db,
        doc! { "createIndexes": "sparse", "indexes": [{ "key": { "s": 1 }, "name": "s_1", "unique": true, "sparse": true }] },
    )
    .await;
    for id in 1..=3 {
        let reply = insert_raw(&t.db, "sparse", doc! { "_id": id }).await;
        assert!(write_errors(&reply).is_empty(), "{reply}");
    }
    let reply = insert_raw(&t.db, "sparse", doc! { "_id": 4, "s": Bson::Null }).await;
    assert!(write_errors(&reply).is_empty(), "{reply}");
    let reply = insert_raw(&t.db, "sparse", doc! { "_id": 5, "s": Bson::Null }).await;
    assert_eq!(
        write_errors(&reply).first().map(|e| int(e, "code")),
        Some(11000),
        "an explicit null is indexed: {reply}"
    );
}

/// https://www.mongodb.com/docs/manual/reference/bson-type-comparison-order/#numeric-types :
/// numbers equal in value are equal whatever their type, `_id` included: Int32 7, Int64 7 and
/// Double 7.0 are one document.
#[tokio::test]
async fn numeric_ids_are_one_document_across_int_long_and_double() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("numids");
    coll.insert_one(doc! { "_id": 7_i32, "v": 1 })
        .await
        .expect("insert");
    for id in [Bson::Int64(7), Bson::Double(7.0)] {
        assert!(
            coll.find_one(doc! { "_id": id.clone() })
                .await
                .expect("find")
                .is_some(),
            "find by {id:?}"
        );
        let e = coll
            .insert_one(doc! { "_id": id.clone() })
            .await
            .expect_err("duplicate");
        assert_eq!(code_of(&e), Some(11000), "insert {id:?}: {e}");
    }
}

/// https://www.mongodb.com/docs/manual/tutorial/query-for-null-fields/ and
/// https://www.mongodb.com/docs/manual/reference/operator/query/nin/ : `$in: [null]` matches a
/// missing field as well as null; `$nin: [null]` and `$ne: null` match neither; `$nin: [1]`
/// matches a missing field.
#[tokio::test]
async fn in_and_nin_take_a_missing_field_as_null() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("membership");
    coll.insert_many([
        doc! { "_id": 1 },
        doc! { "_id": 2, "a": Bson::Null },
        doc! { "_id": 3, "a": 1 },
    ])
    .await
    .expect("insert");
    assert_matches(&coll, doc! { "a": { "$in": [Bson::Null] } }, &[1, 2]).await;
    assert_matches(&coll, doc! { "a": { "$nin": [Bson::Null] } }, &[3]).await;
    assert_matches(&coll, doc! { "a": { "$ne": Bson::Null } }, &[3]).await;
    assert_matches(&coll, doc! { "a": { "$nin": [1] } }, &[1, 2]).await;
    assert_matches(&coll, doc! { "a": { "$in": [5] } }, &[]).await;
}

// ---------------------------------------------------------------------------------------------
// Atomicity, upserts, dates, bulkWrite, $inc
// ---------------------------------------------------------------------------------------------

/// https://www.mongodb.com/docs/manual/core/write-operations-atomicity/ : a write is atomic on one
/// document, so of many compare-and-set updates conditioned on the same value exactly one wins.
#[tokio::test]
async fn conditional_updates_are_atomic_under_contention() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("cas");
    coll.insert_one(doc! { "_id": 1, "n": 0_i64 })
        .await
        .expect("insert");
    let tasks = 48;
    let results = join_all((0..tasks).map(|_| {
        let coll = coll.clone();
        tokio::spawn(async move {
            loop {
                let n = coll
                    .find_one(doc! { "_id": 1 })
                    .await
                    .expect("read")
                    .expect("doc")
                    .get_i64("n")
                    .expect("n");
                let done = coll
                    .update_one(doc! { "_id": 1, "n": n }, doc! { "$set": { "n": n + 1 } })
                    .await
                    .expect("cas");
                if done.modified_count == 1 {
                    return n;
                }
                tokio::task::yield_now().await;
            }
        })
    }))
    .await;
    let won: BTreeSet<i64> = results.into_iter().map(|r| r.expect("task")).collect();
    assert_eq!(won.len(), tasks, "two updates won from the same value");
    let stored = coll
        .find_one(doc! { "_id": 1 })
        .await
        .expect("read")
        .expect("doc");
    assert_eq!(stored.get_i64("n"), Ok(tasks as i64));
}

/// https://www.mongodb.com/docs/manual/reference/method/db.collection.updateOne/#upsert-with-unique-index :
/// concurrent upserts of one `_id` create one document; each either creates it, updates it, or
/// fails with a duplicate key (and changes nothing).
#[tokio::test]
async fn concurrent_upserts_of_one_id_create_one_document() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("upserts");
    let tasks = 32;
    let outcomes = join_all((0..tasks).map(|_| {
        let coll = coll.clone();
        tokio::spawn(async move {
            coll.update_one(doc! { "_id": "x" }, doc! { "$inc": { "n": 1 } })
                .upsert(true)
                .await
        })
    }))
    .await;
    let mut applied = 0;
    let mut created = 0;
    for outcome in outcomes {
        match outcome.expect("task") {
            Ok(done) => {
                applied += 1;
                if done.upserted_id.is_some() {
                    created += 1;
                }
            }
            Err(e) => assert_eq!(code_of(&e), Some(11000), "{e}"),
        }
    }
    let stored = all(&coll).await;
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert_eq!(created, 1);
    assert_eq!(int(&stored[0], "n"), applied);
}

/// https://www.mongodb.com/docs/manual/reference/operator/aggregation/add/ and
/// https://www.mongodb.com/docs/manual/reference/operator/aggregation/subtract/ : in `$expr`,
/// dates compare with dates (and `$$NOW`), a date plus milliseconds is a date, and a date minus a
/// date is milliseconds.
#[tokio::test]
async fn expressions_compare_and_compute_dates() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("dates");
    let past = DateTime::from_millis(DateTime::now().timestamp_millis() - 60_000);
    let future = DateTime::from_millis(DateTime::now().timestamp_millis() + 3_600_000);
    coll.insert_many([doc! { "_id": 1, "d": past }, doc! { "_id": 2, "d": future }])
        .await
        .expect("insert");
    assert_matches(&coll, doc! { "$expr": { "$lt": ["$d", "$$NOW"] } }, &[1]).await;
    assert_matches(
        &coll,
        doc! { "$expr": { "$gt": [{ "$add": ["$d", 120_000] }, "$$NOW"] } },
        &[1, 2],
    )
    .await;
    let reply = command(
        &t.db,
        doc! { "aggregate": "dates", "pipeline": [
            { "$match": { "_id": 2 } },
            { "$project": { "ms": { "$subtract": ["$d", past] }, "later": { "$add": ["$d", 1000] } } },
        ], "cursor": {} },
    )
    .await;
    let row = reply
        .get_document("cursor")
        .and_then(|c| c.get_array("firstBatch"))
        .expect("firstBatch")[0]
        .as_document()
        .expect("row")
        .clone();
    assert_eq!(
        int(&row, "ms"),
        future.timestamp_millis() - past.timestamp_millis()
    );
    assert_eq!(
        row.get_datetime("later").map(|d| d.timestamp_millis()),
        Ok(future.timestamp_millis() + 1000)
    );
}

/// https://www.mongodb.com/docs/manual/reference/operator/aggregation/add/ ("if any argument is
/// null or refers to a field that is missing, `$add` returns null") and
/// https://www.mongodb.com/docs/manual/reference/operator/aggregation/max/ (with several
/// expressions, `$max` ignores null values and missing fields, and returns null only if all are):
/// the batch queue draws a batch's stamp from its service's counter with one upserting
/// `findAndModify` whose pipeline takes the greatest of the counter plus one, the time, and the
/// slot's and mark's stamps plus one, any of them missing.
#[tokio::test]
async fn max_leaves_out_the_nulls_that_adding_to_a_missing_field_gives() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("counters");
    let now = DateTime::from_millis(1_764_000_000_000);
    let draw = |header: &'static str| {
        let coll = coll.clone();
        async move {
            let stamp = doc! { "$max": [
                { "$add": ["$newest", 1] },
                now,
                { "$add": ["$mark_at", 1] },
                { "$cond": [{ "$ne": ["$holder.header", header] }, { "$add": ["$holder.at", 1] }, Bson::Null] },
            ] };
            coll.find_one_and_update(
                doc! { "_id": "s" },
                vec![doc! { "$set": { "newest": stamp } }],
            )
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await
            .expect("draw")
            .expect("document")
            .get_datetime("newest")
            .map(|d| d.timestamp_millis())
            .expect("a date")
        }
    };
    // A new counter: only the time is there.
    assert_eq!(draw("a").await, now.timestamp_millis());
    assert_eq!(draw("b").await, now.timestamp_millis() + 1);
    let later = now.timestamp_millis() + 5_000;
    coll.update_one(
        doc! { "_id": "s" },
        doc! { "$set": {
            "mark_at": DateTime::from_millis(later - 2_000),
            "holder": { "header": "h", "at": DateTime::from_millis(later) },
        } },
    )
    .await
    .expect("slot");
    assert_eq!(draw("c").await, later + 1, "after the slot's batch");
    // The slot's own batch is not after itself: after the counter.
    assert_eq!(draw("h").await, later + 2);
    let all_null =
        t.db.collection::<Document>("counters")
            .aggregate(vec![
                doc! { "$project": { "m": { "$max": [{ "$add": ["$none", 1] }, Bson::Null] } } },
            ])
            .await
            .expect("aggregate")
            .try_collect::<Vec<Document>>()
            .await
            .expect("rows");
    assert_eq!(all_null[0].get("m"), Some(&Bson::Null));
}

/// https://www.mongodb.com/docs/manual/reference/command/bulkWrite/ (8.0+): one command writes to
/// several collections and reports each operation by its index; an unordered bulk goes past a
/// refused entry. Before 8.0 the command does not exist.
#[tokio::test]
async fn bulk_write_reports_each_entry() {
    use mongodb::options::{InsertOneModel, UpdateOneModel, WriteModel};
    let t = TestDb::unprobed().await;
    let a: Collection<Document> = t.db.collection("bulk_a");
    let b: Collection<Document> = t.db.collection("bulk_b");
    a.insert_one(doc! { "_id": 1, "n": 0 }).await.expect("seed");
    let models: Vec<WriteModel> = vec![
        UpdateOneModel::builder()
            .namespace(a.namespace())
            .filter(doc! { "_id": 1 })
            .update(doc! { "$inc": { "n": 1 } })
            .build()
            .into(),
        UpdateOneModel::builder()
            .namespace(a.namespace())
            .filter(doc! { "_id": 2 })
            .update(doc! { "$inc": { "n": 1 } })
            .build()
            .into(),
        InsertOneModel::builder()
            .namespace(a.namespace())
            .document(doc! { "_id": 1 })
            .build()
            .into(),
        InsertOneModel::builder()
            .namespace(b.namespace())
            .document(doc! { "_id": 1 })
            .build()
            .into(),
    ];
    let outcome = t
        .client
        .bulk_write(models)
        .ordered(false)
        .verbose_results()
        .await;
    if version(&t.db).await < (8, 0) {
        assert!(outcome.is_err(), "bulkWrite before 8.0");
        assert_eq!(all(&b).await.len(), 0);
        return;
    }
    let e = outcome.expect_err("the duplicate insert fails");
    let mongodb::error::ErrorKind::BulkWrite(failure) = e.kind.as_ref() else {
        panic!("expected a bulk write error, got {e}");
    };
    assert_eq!(failure.write_errors.len(), 1, "{failure:?}");
    assert_eq!(failure.write_errors.get(&2).map(|w| w.code), Some(11000));
    let Some(mongodb::error::PartialBulkWriteResult::Verbose(done)) = &failure.partial_result
    else {
        panic!("no verbose partial result: {failure:?}");
    };
    assert_eq!(
        done.update_results.get(&0).map(|r| r.matched_count),
        Some(1)
    );
    assert_eq!(
        done.update_results.get(&1).map(|r| r.matched_count),
        Some(0)
    );
    assert!(done.insert_results.contains_key(&3), "{done:?}");
    assert_eq!(all(&b).await, vec![doc! { "_id": 1 }]);
}

/// https://www.mongodb.com/docs/manual/reference/operator/update/inc/ and
/// https://www.mongodb.com/docs/manual/reference/bson-types/#numeric-types : `$inc` of a 32-bit
/// integer past its range gives a 64-bit integer; of a 64-bit integer past its range, an error,
/// with the document unchanged.
#[tokio::test]
async fn inc_widens_32_bit_integers_and_refuses_64_bit_overflow() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("inc");
    coll.insert_many([
        doc! { "_id": 1, "n": i32::MAX },
        doc! { "_id": 2, "n": i64::MAX },
    ])
    .await
    .expect("insert");
    coll.update_one(doc! { "_id": 1 }, doc! { "$inc": { "n": 1 } })
        .await
        .expect("32-bit overflow widens");
    coll.update_one(doc! { "_id": 2 }, doc! { "$inc": { "n": 1 } })
        .await
        .expect_err("64-bit overflow is an error");
    assert_eq!(
        all(&coll).await,
        vec![
            doc! { "_id": 1, "n": i64::from(i32::MAX) + 1 },
            doc! { "_id": 2, "n": i64::MAX },
        ]
    );
}

/// https://www.mongodb.com/docs/manual/reference/method/db.collection.update/#update-with-an-aggregation-pipeline
/// and https://www.mongodb.com/docs/manual/reference/command/findAndModify/ : `findAndModify`
/// takes a pipeline (4.2+) and, with `upsert`, seeds the new document from the query.
#[tokio::test]
async fn find_and_modify_runs_a_pipeline_and_seeds_its_upsert() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("fam");
    let made = coll
        .find_one_and_update(
            doc! { "_id": 1, "kind": "k" },
            vec![doc! { "$set": { "n": { "$add": [{ "$ifNull": ["$n", 0] }, 1] } } }],
        )
        .upsert(true)
        .return_document(ReturnDocument::After)
        .await
        .expect("upsert")
        .expect("doc");
    assert_eq!(made, doc! { "_id": 1, "kind": "k", "n": 1 });
    let before = coll
        .find_one_and_update(
            doc! { "_id": 1 },
            vec![doc! { "$set": { "n": { "$add": ["$n", 1] } } }],
        )
        .await
        .expect("update")
        .expect("doc");
    assert_eq!(before.get_i32("n"), Ok(1));
}

/// https://www.mongodb.com/docs/manual/reference/operator/aggregation/replaceRoot/ and
/// https://www.mongodb.com/docs/manual/reference/aggregation-variables/#mongodb-variable-variable.ROOT :
/// `newRoot` is evaluated once; the document it yields (`$$ROOT`, or one built by `$mergeObjects`
/// or `$cond`) is taken as it is, so stored strings that start with `$` stay strings (mongotx's
/// queries run every document through `$replaceRoot`, and the quota and rate-limiter modules
/// store such strings as names). The same holds for an update pipeline's `$replaceWith`.
#[tokio::test]
async fn stored_dollar_strings_stay_values_through_replace_root() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("dollars");
    let stored =
        doc! { "_id": "$$NOW", "a": { "b": "$abc" }, "s": "$$ROOT", "t": "$x", "l": ["$y"] };
    coll.insert_one(stored.clone()).await.expect("insert");
    let roots = [
        doc! { "$replaceRoot": { "newRoot": "$$ROOT" } },
        doc! { "$replaceRoot": { "newRoot": { "$mergeObjects": ["$$ROOT", {}] } } },
        doc! { "$replaceRoot": { "newRoot": { "$cond": [true, "$$ROOT", {}] } } },
        doc! { "$replaceWith": { "$arrayToObject": { "$objectToArray": "$$ROOT" } } },
    ];
    for stage in roots {
        for leading_match in [false, true] {
            let mut pipeline = Vec::new();
            if leading_match {
                pipeline.push(doc! { "$match": { "t": "$x" } });
            }
            pipeline.push(stage.clone());
            let found: Vec<Document> = coll
                .aggregate(pipeline)
                .await
                .unwrap_or_else(|e| panic!("{stage}: {e}"))
                .try_collect()
                .await
                .unwrap_or_else(|e| panic!("{stage}: {e}"));
            assert_eq!(found, vec![stored.clone()], "{stage}");
        }
    }
    coll.update_one(
        doc! { "_id": "$$NOW" },
        vec![doc! { "$replaceWith": { "$mergeObjects": ["$$ROOT", { "n": 1 }] } }],
    )
    .await
    .expect("a pipeline update keeps the stored strings");
    let mut expected = stored.clone();
    expected.insert("n", 1);
    assert_eq!(all(&coll).await, vec![expected]);
}

// ---------------------------------------------------------------------------------------------
// A document equal to its own literal (the condition of a plain document's first write)
// ---------------------------------------------------------------------------------------------

/// mongotx writes a plain document (one without system fields) only while it is exactly what was
/// read: `{_id, $expr: {$eq: ["$$ROOT", {$literal: <document read>}]}}` (docs/adoption.md).
///
/// - `$literal` returns its value without parsing it, so `$`-prefixed strings in a stored
///   document stay strings (https://www.mongodb.com/docs/manual/reference/operator/aggregation/literal/).
/// - Documents compare field by field, in order, by name and then value; numbers compare by value
///   across types; NaN equals NaN (https://www.mongodb.com/docs/manual/reference/bson-type-comparison-order/).
///   So the stored document equals the literal of itself, whatever types it holds, and a changed
///   value, a field added or removed, or the same fields in another order do not; an int replaced
///   by the long of the same value still does (the fingerprint read before the write tells them
///   apart: docs/adoption.md).
#[tokio::test]
async fn a_document_equals_its_own_literal_and_nothing_else() {
    let t = TestDb::unprobed().await;
    let coll = t.db.collection::<Document>("literal");
    let mut infinity = [0_u8; 16];
    infinity[15] = 0x78;
    let stored = doc! {
        "_id": 1,
        "n": 7,
        "path": "$notapath",
        "nested": { "x": [1, { "y": "$$ROOT" }], "nan": f64::NAN, "zero": -0.0 },
        "dec": Bson::Decimal128(bson::Decimal128::from_bytes(infinity)),
        "when": DateTime::from_millis(1_000),
        "re": Bson::RegularExpression(bson::Regex { pattern: "a.*".into(), options: "i".into() }),
        "min": Bson::MinKey,
        "nothing": Bson::Null,
    };
    coll.insert_one(stored.clone()).await.unwrap();
    let read = coll.find_one(doc! { "_id": 1 }).await.unwrap().unwrap();
    let matches = |literal: Document| {
        let coll = coll.clone();
        async move {
            coll.count_documents(
                doc! { "_id": 1, "$expr": { "$eq": ["$$ROOT", { "$literal": literal }] } },
            )
            .await
            .unwrap()
        }
    };
    assert_eq!(
        matches(read.clone()).await,
        1,
        "a document equals its own literal"
    );
    let mut changed = read.clone();
    changed.insert("n", 8);
    assert_eq!(matches(changed).await, 0, "a changed value");
    let mut added = read.clone();
    added.insert("extra", 1);
    assert_eq!(matches(added).await, 0, "a field added");
    let mut removed = read.clone();
    removed.remove("nothing");
    assert_eq!(matches(removed).await, 0, "a field removed");
    let mut fields: Vec<(String, Bson)> = read.clone().into_iter().collect();
    fields.reverse();
    let reordered: Document = fields.into_iter().collect();
    assert_eq!(
        matches(reordered).await,
        0,
        "the same fields in another order"
    );
    let mut widened = read.clone();
    widened.insert("n", 7_i64);
    assert_eq!(
        matches(widened).await,
        1,
        "numbers compare by value across types"
    );
}

// ---------------------------------------------------------------------------------------------
// The expressions of the rate limiter's writes
// ---------------------------------------------------------------------------------------------

/// The operators the rate limiter's granting and settling pipelines compute with, each as its
/// manual page says (MongoDB 4.0+ for the conversions, 3.2+ for the array operators):
///
/// - https://www.mongodb.com/docs/manual/reference/operator/aggregation/toLong/ : a Date
///   converts to "the number of milliseconds since the epoch";
/// - https://www.mongodb.com/docs/manual/reference/operator/aggregation/divide/ and
///   https://www.mongodb.com/docs/manual/reference/operator/aggregation/floor/ : division gives a
///   double, `$floor` the largest integer not above it;
/// - https://www.mongodb.com/docs/manual/reference/operator/aggregation/slice/ : a negative count
///   keeps that many elements from the end;
/// - https://www.mongodb.com/docs/manual/reference/operator/aggregation/concatArrays/,
///   https://www.mongodb.com/docs/manual/reference/operator/aggregation/in/ and
///   https://www.mongodb.com/docs/manual/reference/operator/aggregation/arrayElemAt/ ;
/// - https://www.mongodb.com/docs/manual/reference/operator/aggregation/filter/,
///   https://www.mongodb.com/docs/manual/reference/operator/aggregation/map/ and
///   https://www.mongodb.com/docs/manual/reference/operator/aggregation/sum/ (`$sum` of an array
///   expression adds its elements; of an empty array, 0);
/// - https://www.mongodb.com/docs/manual/meta/aggregation-quick-reference/#expressions : an array
///   literal is an expression whose elements are each evaluated;
/// - https://www.mongodb.com/docs/manual/reference/command/findAndModify/ : with `new: true` a
///   pipeline update returns the document it wrote, fields computed by earlier stages included,
///   and `$unset` stages drop the temporary ones.
#[tokio::test]
async fn the_rate_limiters_pipeline_expressions_compute_as_the_manual_says() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("expressions");
    let at = DateTime::from_millis(1_764_000_123_456);
    coll.insert_one(doc! {
        "_id": 1,
        "at": at,
        "width": 100_i64,
        "ring": [{ "k": "a", "q": 1_i64 }, { "k": "b", "q": 2_i64 }, { "k": "c", "q": 3_i64 }],
        "slots": [{ "s": 4_i64, "n": 5_i64 }, { "s": 9_i64, "n": 7_i64 }],
    })
    .await
    .expect("insert");
    let written = coll
        .find_one_and_update(
            doc! { "_id": 1 },
            vec![
                doc! { "$set": { "_ms": { "$toLong": "$at" } } },
                doc! { "$set": {
                    "ms": "$_ms",
                    "slot": { "$toLong": { "$floor": { "$divide": ["$_ms", "$width"] } } },
                    "last_two": { "$slice": [{ "$concatArrays": ["$ring", [{ "k": "d", "q": 4_i64 }]] }, -2] },
                    "has_b": { "$in": ["b", { "$map": { "input": "$ring", "as": "r", "in": "$$r.k" } }] },
                    "has_z": { "$in": ["z", { "$map": { "input": "$ring", "as": "r", "in": "$$r.k" } }] },
                    "oldest": { "$arrayElemAt": [{ "$map": { "input": "$ring", "as": "r", "in": "$$r.q" } }, 0] },
                    "late": { "$sum": { "$map": {
                        "input": { "$filter": { "input": "$slots", "as": "x", "cond": { "$gte": ["$$x.s", 5_i64] } } },
                        "as": "x",
                        "in": "$$x.n",
                    } } },
                    "none": { "$sum": { "$map": {
                        "input": { "$filter": { "input": "$slots", "as": "x", "cond": { "$gt": ["$$x.s", 100_i64] } } },
                        "as": "x",
                        "in": "$$x.n",
                    } } },
                    "low": { "$max": [0_i64, { "$add": [3_i64, -5_i64] }] },
                    "first": { "$min": [12_i64, 7_i64] },
                    "built": [{ "k": "$width" }, "$width", { "$add": [1_i64, 2_i64] }, "plain"],
                    "appended": { "$concatArrays": [[], [{ "s": "$_ms" }]] },
                } },
                doc! { "$unset": ["_ms"] },
            ],
        )
        .return_document(ReturnDocument::After)
        .await
        .expect("findAndModify with a pipeline")
        .expect("the document");
    assert_eq!(written.get_i64("ms"), Ok(1_764_000_123_456), "{written}");
    assert_eq!(written.get_i64("slot"), Ok(17_640_001_234), "{written}");
    let last_two: Vec<&str> = written
        .get_array("last_two")
        .expect("last_two")
        .iter()
        .map(|e| {
            e.as_document()
                .and_then(|d| d.get_str("k").ok())
                .unwrap_or("?")
        })
        .collect();
    assert_eq!(last_two, ["c", "d"], "{written}");
    assert_eq!(written.get_bool("has_b"), Ok(true), "{written}");
    assert_eq!(written.get_bool("has_z"), Ok(false), "{written}");
    assert_eq!(written.get_i64("oldest"), Ok(1), "{written}");
    assert_eq!(int(&written, "late"), 7, "{written}");
    assert_eq!(int(&written, "none"), 0, "{written}");
    assert_eq!(written.get_i64("low"), Ok(0), "{written}");
    assert_eq!(written.get_i64("first"), Ok(7), "{written}");
    assert_eq!(
        written.get_array("built").ok(),
        Some(&vec![
            Bson::Document(doc! { "k": 100_i64 }),
            Bson::Int64(100),
            Bson::Int64(3),
            Bson::from("plain"),
        ]),
        "every element of an array literal is evaluated: {written}"
    );
    assert_eq!(
        written.get_array("appended").ok(),
        Some(&vec![Bson::Document(doc! { "s": 1_764_000_123_456_i64 })]),
        "{written}"
    );
    assert!(!written.contains_key("_ms"), "{written}");
}

/// Updates by id lists and the positional operator, as every page of the GC sends them: an `_id`
/// `$in` list beside other conditions matches the listed documents that meet the conditions too,
/// whatever the list's length (the local server once compared each document with every listed
/// id); and `arr.$` changes the element the filter matched, only when the update names it.
/// Manual: <https://www.mongodb.com/docs/manual/reference/operator/query/in/> and
/// <https://www.mongodb.com/docs/manual/reference/operator/update/positional/>.
#[tokio::test]
async fn id_lists_and_the_positional_operator_match_as_the_manual_says() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("id_lists");
    let docs: Vec<Document> = (0..3000)
        .map(|i| doc! { "_id": i, "even": i % 2 == 0, "arr": [i, i + 1, i + 2] })
        .collect();
    coll.insert_many(docs).await.unwrap();
    let listed: Vec<i32> = (0..2000).collect();
    let found = ids(
        &coll,
        doc! { "_id": { "$in": listed.clone() }, "even": true },
        doc! { "_id": 1 },
    )
    .await;
    let expected: Vec<Bson> = (0..2000).filter(|i| i % 2 == 0).map(Bson::Int32).collect();
    assert_eq!(found, expected, "an $in list beside another condition");
    let updated = coll
        .update_many(
            doc! { "_id": { "$in": listed }, "even": false },
            doc! { "$set": { "odd": true } },
        )
        .await
        .unwrap();
    assert_eq!(updated.matched_count, 1000);
    assert_eq!(updated.modified_count, 1000);
    assert_matches(&coll, doc! { "odd": true, "_id": { "$gte": 2000 } }, &[]).await;
    // An equality on `_id` beside a condition the document fails matches nothing.
    let missed = coll
        .update_one(doc! { "_id": 7, "even": true }, doc! { "$set": { "x": 1 } })
        .await
        .unwrap();
    assert_eq!(missed.matched_count, 0);
    // The positional operator: the first element the filter matched.
    coll.update_one(
        doc! { "_id": 10, "arr": 11 },
        doc! { "$set": { "arr.$": 100 } },
    )
    .await
    .unwrap();
    let ten = coll.find_one(doc! { "_id": 10 }).await.unwrap().unwrap();
    assert_eq!(
        ten.get_array("arr").unwrap(),
        &vec![Bson::Int32(10), Bson::Int32(100), Bson::Int32(12)]
    );
    // Without a match of the array in the filter, `arr.$` is refused (code 2, BadValue).
    let refused = coll
        .update_one(doc! { "_id": 11 }, doc! { "$set": { "arr.$": 1 } })
        .await
        .unwrap_err();
    assert_eq!(code_of(&refused), Some(2), "{refused}");
}

/// Aggregations that start by matching, as the GC's and the records' clock's reads do: a leading
/// `$match` with `$sort` and `$limit` yields the first documents in sort order (ties in the order
/// of the later keys), a `$limit` before a `$sort` sorts only the documents it let through, and a
/// `$sort` without a limit sorts every match. Manual:
/// <https://www.mongodb.com/docs/manual/core/aggregation-pipeline-optimization/> ($sort + $limit
/// coalescence changes the plan, never the result) and
/// <https://www.mongodb.com/docs/manual/reference/operator/aggregation/limit/>.
#[tokio::test]
async fn a_leading_match_sort_and_limit_answer_as_the_stages_in_turn() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("match_sort_limit");
    let docs: Vec<Document> = (0..40)
        .map(|i| doc! { "_id": i, "group": i % 2, "rank": i % 5 })
        .collect();
    coll.insert_many(docs).await.unwrap();
    let run = |pipeline: Vec<Document>| {
        let coll = coll.clone();
        async move {
            coll.aggregate(pipeline)
                .await
                .unwrap()
                .try_collect::<Vec<Document>>()
                .await
                .unwrap()
                .into_iter()
                .map(|d| d.get("_id").cloned().unwrap_or(Bson::Null))
                .collect::<Vec<Bson>>()
        }
    };
    let int = |v: &[i32]| v.iter().map(|i| Bson::Int32(*i)).collect::<Vec<Bson>>();
    // Even ids whose rank is 4 are 4, 14, 24, 34; then rank 3: 8, 18, ...
    let top = run(vec![
        doc! { "$match": { "group": 0 } },
        doc! { "$sort": { "rank": -1, "_id": 1 } },
        doc! { "$limit": 5 },
    ])
    .await;
    assert_eq!(top, int(&[4, 14, 24, 34, 8]), "$match, $sort, $limit");
    let first_two_sorted = run(vec![
        doc! { "$match": { "group": 1 } },
        doc! { "$sort": { "_id": 1 } },
        doc! { "$limit": 2 },
        doc! { "$sort": { "_id": -1 } },
    ])
    .await;
    assert_eq!(
        first_two_sorted,
        int(&[3, 1]),
        "$limit, then $sort of those"
    );
    let all_sorted = run(vec![
        doc! { "$match": { "rank": 0 } },
        doc! { "$sort": { "_id": -1 } },
    ])
    .await;
    assert_eq!(
        all_sorted,
        int(&[35, 30, 25, 20, 15, 10, 5, 0]),
        "$sort without a limit"
    );
    let one = coll
        .aggregate(vec![
            doc! { "$match": {} },
            doc! { "$limit": 1 },
            doc! { "$project": { "_id": 0, "now": "$$NOW" } },
        ])
        .await
        .unwrap()
        .try_collect::<Vec<Document>>()
        .await
        .unwrap();
    assert_eq!(one.len(), 1, "$limit 1: {one:?}");
    assert!(one[0].get_datetime("now").is_ok(), "{one:?}");
}

/// A replacement (whole-document update) leaves the document with the replacement's fields only,
/// keeps its `_id`, and is refused with code 11000 when it would repeat a unique index's key,
/// changing nothing. Manual:
/// <https://www.mongodb.com/docs/manual/reference/method/db.collection.replaceOne/> and
/// <https://www.mongodb.com/docs/manual/core/index-unique/>.
#[tokio::test]
async fn a_replacement_keeps_only_its_fields_and_its_unique_keys_are_checked() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("replacements");
    command(
        &t.db,
        doc! { "createIndexes": "replacements", "indexes": [
            { "key": { "email": 1 }, "name": "email_1", "unique": true }
        ] },
    )
    .await;
    coll.insert_many(vec![
        doc! { "_id": 1, "email": "a@x", "note": "first", "n": 1 },
        doc! { "_id": 2, "email": "b@x", "note": "second" },
    ])
    .await
    .unwrap();
    let replaced = coll
        .replace_one(doc! { "_id": 1 }, doc! { "email": "c@x", "n": 2 })
        .await
        .unwrap();
    assert_eq!((replaced.matched_count, replaced.modified_count), (1, 1));
    let one = coll.find_one(doc! { "_id": 1 }).await.unwrap().unwrap();
    assert_eq!(one, doc! { "_id": 1, "email": "c@x", "n": 2 });
    // The old key is free again, the new one taken.
    coll.insert_one(doc! { "_id": 3, "email": "a@x" })
        .await
        .unwrap();
    let refused = coll
        .replace_one(doc! { "_id": 2 }, doc! { "email": "c@x" })
        .await
        .unwrap_err();
    assert_eq!(code_of(&refused), Some(11000), "{refused}");
    let two = coll.find_one(doc! { "_id": 2 }).await.unwrap().unwrap();
    assert_eq!(two, doc! { "_id": 2, "email": "b@x", "note": "second" });
    let by_email = ids(&coll, doc! { "email": "c@x" }, doc! { "_id": 1 }).await;
    assert_eq!(by_email, vec![Bson::Int32(1)]);
}

/// https://www.mongodb.com/docs/manual/tutorial/query-embedded-documents/ : an equality match on
/// a whole embedded document requires the exact document, field order included. mongotx's quota
/// providers have such ids and every conditional write names one beside other conditions (and a
/// striped provider is read with an `$in` of them), which the local server answers from the `_id`
/// index: the answer must be the matcher's.
#[tokio::test]
async fn an_embedded_document_id_matches_exactly_beside_other_conditions_and_in_a_list() {
    let t = TestDb::unprobed().await;
    let coll: Collection<Document> = t.db.collection("embedded_ids");
    let id = |scope: &str, stripe: Option<i64>| {
        let mut id = doc! { "scope": scope, "resource": "cores" };
        if let Some(s) = stripe {
            id.insert("stripe", s);
        }
        id
    };
    for (scope, stripe, n) in [
        ("a", None, 1),
        ("a", Some(1), 2),
        ("b", None, 3),
        ("b", Some(1), 4),
    ] {
        coll.insert_one(doc! { "_id": id(scope, stripe), "n": n })
            .await
            .unwrap();
    }
    let by = |filter: Document| {
        let coll = coll.clone();
        async move { ids(&coll, filter, doc! { "n": 1 }).await }
    };
    assert_eq!(
        by(doc! { "_id": id("a", Some(1)), "n": { "$gte": 2 } })
            .await
            .len(),
        1
    );
    assert!(by(doc! { "_id": id("a", Some(1)), "n": { "$gte": 3 } })
        .await
        .is_empty());
    // The same fields in another order are another document.
    let permuted = doc! { "resource": "cores", "scope": "a" };
    assert!(by(doc! { "_id": &permuted, "n": { "$gte": 0 } })
        .await
        .is_empty());
    assert!(by(doc! { "_id": { "$in": [&permuted] }, "n": 1 })
        .await
        .is_empty());
    let listed = by(doc! {
        "_id": { "$in": [id("a", None), id("b", Some(1)), id("c", None), &permuted] },
        "n": { "$gte": 0 },
    })
    .await;
    assert_eq!(
        listed,
        vec![
            Bson::Document(id("a", None)),
            Bson::Document(id("b", Some(1)))
        ]
    );
    let updated = coll
        .update_one(
            doc! { "_id": id("b", None), "n": 3 },
            doc! { "$inc": { "n": 10 } },
        )
        .await
        .unwrap();
    assert_eq!((updated.matched_count, updated.modified_count), (1, 1));
    let missed = coll
        .update_one(
            doc! { "_id": &permuted, "n": 1 },
            doc! { "$inc": { "n": 10 } },
        )
        .await
        .unwrap();
    assert_eq!(missed.matched_count, 0);
}
