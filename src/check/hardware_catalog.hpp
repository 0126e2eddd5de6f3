// The text of hardware/catalog.yaml, compiled into epx (hardware_catalog.cpp is generated).
#pragma once

namespace epx {

const char* builtin_hardware_yaml();

}  // namespace epx
