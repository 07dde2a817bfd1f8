//! The BSON types a schema can name: [`BsonType`], its table of `bsonType` aliases (`"int"`,
//! `"objectId"`, ...) and the numeric types that the alias `"number"` stands for.

use std::fmt;

use bson::Bson;

/// The type of a BSON value, spelled as MongoDB's `bsonType` aliases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BsonType {
    /// 64-bit binary floating point.
    Double,
    /// UTF-8 string.
    String,
    /// Embedded document.
    Object,
    /// Array.
    Array,
    /// Binary data.
    BinData,
    /// Deprecated `undefined`.
    Undefined,
    /// ObjectId.
    ObjectId,
    /// Boolean.
    Bool,
    /// UTC datetime.
    Date,
    /// Null.
    Null,
    /// Regular expression.
    Regex,
    /// Deprecated DBPointer.
    DbPointer,
    /// JavaScript code.
    JavaScript,
    /// Deprecated symbol.
    Symbol,
    /// JavaScript code with scope.
    JavaScriptWithScope,
    /// 32-bit integer.
    Int,
    /// Internal timestamp.
    Timestamp,
    /// 64-bit integer.
    Long,
    /// 128-bit decimal floating point.
    Decimal,
    /// The lowest key.
    MinKey,
    /// The highest key.
    MaxKey,
}

/// Every type, in the order MongoDB numbers them.
const ALL_TYPES: [BsonType; 21] = [
    BsonType::Double,
    BsonType::String,
    BsonType::Object,
    BsonType::Array,
    BsonType::BinData,
    BsonType::Undefined,
    BsonType::ObjectId,
    BsonType::Bool,
    BsonType::Date,
    BsonType::Null,
    BsonType::Regex,
    BsonType::DbPointer,
    BsonType::JavaScript,
    BsonType::Symbol,
    BsonType::JavaScriptWithScope,
    BsonType::Int,
    BsonType::Timestamp,
    BsonType::Long,
    BsonType::Decimal,
    BsonType::MinKey,
    BsonType::MaxKey,
];

/// The types `number` stands for.
pub(super) const NUMERIC: [BsonType; 4] = [
    BsonType::Double,
    BsonType::Int,
    BsonType::Long,
    BsonType::Decimal,
];

impl BsonType {
    /// The type of a value.
    pub fn of(value: &Bson) -> BsonType {
        match value {
            Bson::Double(_) => BsonType::Double,
            Bson::String(_) => BsonType::String,
            Bson::Document(_) => BsonType::Object,
            Bson::Array(_) => BsonType::Array,
            Bson::Binary(_) => BsonType::BinData,
            Bson::Undefined => BsonType::Undefined,
            Bson::ObjectId(_) => BsonType::ObjectId,
            Bson::Boolean(_) => BsonType::Bool,
            Bson::DateTime(_) => BsonType::Date,
            Bson::Null => BsonType::Null,
            Bson::RegularExpression(_) => BsonType::Regex,
            Bson::DbPointer(_) => BsonType::DbPointer,
            Bson::JavaScriptCode(_) => BsonType::JavaScript,
            Bson::Symbol(_) => BsonType::Symbol,
            Bson::JavaScriptCodeWithScope(_) => BsonType::JavaScriptWithScope,
            Bson::Int32(_) => BsonType::Int,
            Bson::Timestamp(_) => BsonType::Timestamp,
            Bson::Int64(_) => BsonType::Long,
            Bson::Decimal128(_) => BsonType::Decimal,
            Bson::MinKey => BsonType::MinKey,
            Bson::MaxKey => BsonType::MaxKey,
        }
    }

    /// The `bsonType` alias MongoDB uses for this type.
    pub fn alias(self) -> &'static str {
        match self {
            BsonType::Double => "double",
            BsonType::String => "string",
            BsonType::Object => "object",
            BsonType::Array => "array",
            BsonType::BinData => "binData",
            BsonType::Undefined => "undefined",
            BsonType::ObjectId => "objectId",
            BsonType::Bool => "bool",
            BsonType::Date => "date",
            BsonType::Null => "null",
            BsonType::Regex => "regex",
            BsonType::DbPointer => "dbPointer",
            BsonType::JavaScript => "javascript",
            BsonType::Symbol => "symbol",
            BsonType::JavaScriptWithScope => "javascriptWithScope",
            BsonType::Int => "int",
            BsonType::Timestamp => "timestamp",
            BsonType::Long => "long",
            BsonType::Decimal => "decimal",
            BsonType::MinKey => "minKey",
            BsonType::MaxKey => "maxKey",
        }
    }

    /// The type a `bsonType` alias names (`number` names several and is not accepted here).
    pub fn from_alias(alias: &str) -> Option<BsonType> {
        ALL_TYPES.into_iter().find(|t| t.alias() == alias)
    }

    /// Whether values of this type are numbers.
    pub fn is_numeric(self) -> bool {
        NUMERIC.contains(&self)
    }
}

impl fmt::Display for BsonType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.alias())
    }
}
