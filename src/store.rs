//! The entry point: a database handle plus the settings every repository shares.

use std::sync::Arc;

use bson::{doc, Document};
use mongodb::options::IndexOptions;
use mongodb::{Database, IndexModel};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::OnceCell;

use crate::collection::CollectionSpec;
use crate::error::RepoError;
use crate::fields;
use crate::hold::{HoldResolver, LockWait};
use crate::probe;
use crate::recovery::TransactionHolds;
use crate::repository::Repository;
use crate::worklist::TRANSACTIONS_COLLECTION;

/// Whether to install each collection's schema as a server-side `$jsonSchema` validator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ServerValidation {
    /// Install it when the server is found to enforce validators (checked once per store).
    #[default]
    Auto,
    /// Always install it (for servers known to support it).
    Always,
    /// Never install it; validate on the client only.
    Never,
}

/// A database plus shared settings; opens typed repositories. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    pub(crate) inner: Arc<StoreInner>,
}

pub(crate) struct StoreInner {
    pub(crate) db: Database,
    pub(crate) lock_wait: LockWait,
    pub(crate) holds: Arc<dyn HoldResolver>,
    pub(crate) txns_collection: String,
    validation: ServerValidation,
    validator_support: OnceCell<bool>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("database", &self.inner.db.name())
            .field("lock_wait", &self.inner.lock_wait)
            .field("validation", &self.inner.validation)
            .finish()
    }
}

/// Builds a [`Store`] with non-default settings.
pub struct StoreBuilder {
    db: Database,
    lock_wait: LockWait,
    holds: Option<Arc<dyn HoldResolver>>,
    txns_collection: String,
    validation: ServerValidation,
}

impl StoreBuilder {
    /// Sets how writers wait for documents held by transactions.
    pub fn lock_wait(mut self, lock_wait: LockWait) -> StoreBuilder {
        self.lock_wait = lock_wait;
        self
    }

    /// Replaces the transaction layer's resolver for held documents (for tests and tools).
    pub fn hold_resolver(mut self, holds: Arc<dyn HoldResolver>) -> StoreBuilder {
        self.holds = Some(holds);
        self
    }

    /// Sets the collection of ActiveTransaction documents (default `mongotx_transactions`).
    pub fn transactions_collection(mut self, name: impl Into<String>) -> StoreBuilder {
        self.txns_collection = name.into();
        self
    }

    /// Sets whether schemas are installed as server-side validators.
    pub fn server_validation(mut self, validation: ServerValidation) -> StoreBuilder {
        self.validation = validation;
        self
    }

    /// Finishes the store.
    pub fn build(self) -> Store {
        Store {
            inner: Arc::new(StoreInner {
                db: self.db,
                lock_wait: self.lock_wait,
                holds: self.holds.unwrap_or_else(|| {
                    Arc::new(TransactionHolds::new(self.txns_collection.clone()))
                }),
                txns_collection: self.txns_collection,
                validation: self.validation,
                validator_support: OnceCell::new(),
            }),
        }
    }
}

impl Store {
    /// A store on `db` with default settings.
    pub fn new(db: Database) -> Store {
        Store::builder(db).build()
    }

    /// A builder for a store on `db`.
    pub fn builder(db: Database) -> StoreBuilder {
        StoreBuilder {
            db,
            lock_wait: LockWait::default(),
            holds: None,
            txns_collection: TRANSACTIONS_COLLECTION.to_string(),
            validation: ServerValidation::default(),
        }
    }

    /// The underlying database handle.
    pub fn database(&self) -> &Database {
        &self.inner.db
    }

    /// The lock-wait policy writers use.
    pub fn lock_wait(&self) -> LockWait {
        self.inner.lock_wait
    }

    /// The collection holding ActiveTransaction documents.
    pub fn transactions_collection(&self) -> &str {
        &self.inner.txns_collection
    }

    /// Opens a typed repository: checks the definition, creates the system indexes and installs
    /// the server-side validator where supported. Idempotent.
    pub async fn repository<T>(&self, spec: CollectionSpec) -> Result<Repository<T>, RepoError>
    where
        T: Serialize + DeserializeOwned + Send + Sync,
    {
        spec.check_upgrades()?;
        let name = spec.name().to_string();
        let db_error = |operation: &'static str| {
            let collection = name.clone();
            move |source| RepoError::Database {
                collection,
                id: "*".to_string(),
                operation,
                source: Box::new(source),
            }
        };

        if self.installs_validator().await {
            self.install_validator(&spec)
                .await
                .map_err(db_error("installing the validator"))?;
        } else {
            tracing::info!(
                collection = %name,
                "server does not enforce $jsonSchema validators; documents are validated on the client only"
            );
        }

        let coll = self.inner.db.collection::<Document>(&name);
        // Sparse indexes: only tombstones and held documents carry these fields, and purge and
        // GC look documents up by them.
        let sparse = |field: &str| {
            IndexModel::builder()
                .keys(doc! { field: 1 })
                .options(IndexOptions::builder().sparse(true).build())
                .build()
        };
        coll.create_indexes([sparse(fields::DELETED), sparse(fields::ACTIVE_TXN)])
            .await
            .map_err(db_error("creating indexes"))?;

        Ok(Repository::new(self.clone(), Arc::new(spec), coll))
    }

    async fn installs_validator(&self) -> bool {
        match self.inner.validation {
            ServerValidation::Always => true,
            ServerValidation::Never => false,
            ServerValidation::Auto => {
                *self
                    .inner
                    .validator_support
                    .get_or_init(|| probe::validator_support(&self.inner.db))
                    .await
            }
        }
    }

    async fn install_validator(&self, spec: &CollectionSpec) -> Result<(), mongodb::error::Error> {
        // Tombstones have their user fields cleared, so the schema applies to live documents only.
        let validator = doc! {
            "$or": [
                { fields::DELETED: { "$exists": true } },
                { "$jsonSchema": spec.schema().to_document() },
            ]
        };
        let created = self
            .inner
            .db
            .run_command(doc! { "create": spec.name(), "validator": validator.clone() })
            .await;
        match created {
            Ok(_) => Ok(()),
            Err(e) if probe::error_code(&e) == Some(NAMESPACE_EXISTS) => self
                .inner
                .db
                .run_command(doc! { "collMod": spec.name(), "validator": validator })
                .await
                .map(|_| ()),
            Err(e) => Err(e),
        }
    }
}

const NAMESPACE_EXISTS: i32 = 48;
