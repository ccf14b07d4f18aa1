// The fields live in a .def file included wherever they are needed.
#pragma once
#include <stdint.h>

#ifndef P3_MAX_RANKS
#define P3_MAX_RANKS 8
#endif

struct P3PeerSendConfig {
#define P3_FIELD(type, name) type name;
#define P3_FIELD_ARRAY(type, name, n) type name[n];
#include "c_xmacro_fields.def"
#undef P3_FIELD
#undef P3_FIELD_ARRAY
};
