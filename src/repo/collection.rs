//! Collection definitions: name, current schema version, upgrade steps and JSON Schema.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use bson::Document;
use thiserror::Error;

use crate::error_kind::ErrorKind;
use crate::repo::fields;
use crate::repo::schema::{BsonType, JsonSchema, SchemaError};

/// One upgrade step: turns a document of schema version `n` into version `n + 1`.
pub type UpgradeStep = Arc<dyn Fn(Document) -> Result<Document, String> + Send + Sync>;

/// Why a collection definition cannot be used.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SpecError {
    /// The JSON Schema text is not a usable schema.
    #[error("unusable JSON Schema: {source}")]
    Schema {
        /// What is wrong with it.
        #[from]
        source: SchemaError,
    },
    /// The schema does not declare a system field the way mongotx stores it.
    #[error("collection {collection}: schema must declare system field `{field}` {requirement}")]
    SystemField {
        /// Collection name.
        collection: String,
        /// The field.
        field: &'static str,
        /// What the schema must say about it.
        requirement: &'static str,
    },
    /// The schema version or the upgrade steps are inconsistent.
    #[error("collection {collection}: {reason}")]
    Versions {
        /// Collection name.
        collection: String,
        /// What is inconsistent.
        reason: String,
    },
    /// The collection name is not usable.
    #[error("collection name {name:?} is invalid: {reason}")]
    Name {
        /// The name given.
        name: String,
        /// Why it is rejected.
        reason: &'static str,
    },
}

impl SpecError {
    /// What kind of failure this is: always [`ErrorKind::InvalidInput`] (the definition is the
    /// caller's).
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidInput
    }

    /// Whether trying again may succeed: never, the definition must change.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// Everything mongotx needs to know about one collection.
#[derive(Clone)]
pub struct CollectionSpec {
    name: String,
    schema_version: i64,
    schema: JsonSchema,
    upgrades: BTreeMap<i64, UpgradeStep>,
    plain_schema_version: i64,
}

impl fmt::Debug for CollectionSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CollectionSpec")
            .field("name", &self.name)
            .field("schema_version", &self.schema_version)
            .field("upgrades_from", &self.upgrades.keys().collect::<Vec<_>>())
            .field("plain_schema_version", &self.plain_schema_version)
            .finish()
    }
}

impl CollectionSpec {
    /// Defines a collection from its name, current schema version and JSON Schema text.
    pub fn new(
        name: impl Into<String>,
        schema_version: i64,
        schema_json: &str,
    ) -> Result<CollectionSpec, SpecError> {
        let name = name.into();
        let schema = JsonSchema::parse(&name, schema_json)?;
        CollectionSpec::with_schema(name, schema_version, schema)
    }

    /// Defines a collection from an already parsed schema.
    pub fn with_schema(
        name: impl Into<String>,
        schema_version: i64,
        schema: JsonSchema,
    ) -> Result<CollectionSpec, SpecError> {
        let name = name.into();
        check_name(&name)?;
        if schema_version < 1 {
            return Err(SpecError::Versions {
                collection: name,
                reason: format!("schema version must be at least 1, got {schema_version}"),
            });
        }
        check_system_fields(&name, &schema)?;
        Ok(CollectionSpec {
            name,
            schema_version,
            schema,
            upgrades: BTreeMap::new(),
            plain_schema_version: 1,
        })
    }

    /// Adds the step that upgrades documents from schema version `from` to `from + 1`.
    pub fn upgrade(
        mut self,
        from: i64,
        step: impl Fn(Document) -> Result<Document, String> + Send + Sync + 'static,
    ) -> CollectionSpec {
        self.upgrades.insert(from, Arc::new(step));
        self
    }

    /// Declares the schema version of the collection's *plain* documents: those without system
    /// fields, written before the collection was adopted or by other writers since (default 1,
    /// the first shape). They read as that version and are upgraded from it by the upgrade steps,
    /// like stamped documents of that version; their first write stamps them. Keep it where it
    /// is when the collection's schema version moves on: the plain documents do not change shape
    /// because the code did. Checked when the repository opens (between 1 and the current
    /// version).
    ///
    /// ```
    /// # fn demo(schema_v2: &str) -> Result<(), mongotx::schema::SpecError> {
    /// use mongotx::CollectionSpec;
    ///
    /// // Legacy documents have one `name`; version 2 splits it.
    /// let spec = CollectionSpec::new("people", 2, schema_v2)?
    ///     .upgrade(1, |mut doc| {
    ///         let name = doc.remove("name").unwrap_or(bson::Bson::Null);
    ///         doc.insert("display_name", name);
    ///         Ok(doc)
    ///     })
    ///     .plain_documents(1);
    /// # let _ = spec; Ok(()) }
    /// ```
    pub fn plain_documents(mut self, schema_version: i64) -> CollectionSpec {
        self.plain_schema_version = schema_version;
        self
    }

    /// The schema version plain documents read as (see [`plain_documents`](Self::plain_documents)).
    pub fn plain_schema_version(&self) -> i64 {
        self.plain_schema_version
    }

    /// The collection name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The schema version new writes are stamped with.
    pub fn schema_version(&self) -> i64 {
        self.schema_version
    }

    /// The collection's JSON Schema.
    pub fn schema(&self) -> &JsonSchema {
        &self.schema
    }

    /// Checks that every older version has an upgrade step, no step targets a future version, and
    /// the plain documents' version is one of the collection's.
    pub fn check_upgrades(&self) -> Result<(), SpecError> {
        if !(1..=self.schema_version).contains(&self.plain_schema_version) {
            return Err(SpecError::Versions {
                collection: self.name.clone(),
                reason: format!(
                    "plain documents are declared at schema version {}, which is not between 1 and the current version {}",
                    self.plain_schema_version, self.schema_version
                ),
            });
        }
        for from in 1..self.schema_version {
            if !self.upgrades.contains_key(&from) {
                return Err(SpecError::Versions {
                    collection: self.name.clone(),
                    reason: format!(
                        "schema version is {} but there is no upgrade step from version {from}",
                        self.schema_version
                    ),
                });
            }
        }
        if let Some((&from, _)) = self
            .upgrades
            .iter()
            .find(|(&from, _)| from < 1 || from >= self.schema_version)
        {
            return Err(SpecError::Versions {
                collection: self.name.clone(),
                reason: format!(
                    "upgrade step from version {from} does not lead to a version between 2 and {}",
                    self.schema_version
                ),
            });
        }
        Ok(())
    }

    /// Runs the upgrade steps from `from` to the current version; `Err` carries the failing version.
    pub(crate) fn upgrade_document(
        &self,
        mut doc: Document,
        from: i64,
    ) -> Result<Document, (i64, String)> {
        for version in from..self.schema_version {
            let step = self
                .upgrades
                .get(&version)
                .ok_or_else(|| (version, "no upgrade step is defined".to_string()))?;
            doc = step(doc).map_err(|reason| (version, reason))?;
            if fields::RESERVED.iter().any(|f| doc.contains_key(*f)) {
                return Err((version, "the step set a system field".to_string()));
            }
        }
        Ok(doc)
    }
}

pub(crate) fn check_name(name: &str) -> Result<(), SpecError> {
    match crate::collections::server_refuses(name) {
        Some(reason) => Err(SpecError::Name {
            name: name.to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

fn check_system_fields(collection: &str, schema: &JsonSchema) -> Result<(), SpecError> {
    let expect = |field: &'static str, ty: BsonType, required: bool, requirement: &'static str| {
        let typed = schema
            .allowed_types(field)
            .is_some_and(|types| types.contains(&ty));
        let is_required = schema.validate_unset(field).is_err();
        if typed && is_required == required {
            Ok(())
        } else {
            Err(SpecError::SystemField {
                collection: collection.to_string(),
                field,
                requirement,
            })
        }
    };
    if schema.allowed_types("_id").is_none() || schema.validate_unset("_id").is_ok() {
        return Err(SpecError::SystemField {
            collection: collection.to_string(),
            field: "_id",
            requirement: "as a required property with a bsonType",
        });
    }
    expect(
        fields::SCHEMA_VERSION,
        BsonType::Long,
        true,
        "as a required property of bsonType long",
    )?;
    expect(
        fields::VERSION,
        BsonType::Long,
        true,
        "as a required property of bsonType long",
    )?;
    expect(
        fields::ACTIVE_TXN,
        BsonType::ObjectId,
        false,
        "as an optional property of bsonType objectId",
    )?;
    expect(
        fields::DELETED,
        BsonType::Date,
        false,
        "as an optional property of bsonType date",
    )?;
    expect(
        fields::DELETING,
        BsonType::Bool,
        false,
        "as an optional property of bsonType bool",
    )?;
    Ok(())
}
